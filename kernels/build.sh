#!/usr/bin/env bash
# Compile kernels/kvbm_copy.cu (needs nvcc; run on the GPU machine) into
#   kvbm_copy.fatbin  SASS for sm_80 (A100) and sm_90 (H100/H200)
#   kvbm_copy.ptx     compute_80 PTX, for other GPUs (JIT-compiled by the driver)
# The PTX's .version line is lowered to 7.0 (CUDA 11.0) so that drivers older
# than the nvcc that built it still JIT it; the kernels use no newer feature.
# Then `go run kernels/gen.go` (here, with Go) regenerates goext/cuda/kernels_gen_cuda.go.
set -euo pipefail
cd "$(dirname "$0")"
nvcc --version | tail -2
nvcc -O3 -fatbin -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -o kvbm_copy.fatbin kvbm_copy.cu
nvcc -O3 -ptx -arch=compute_80 -o kvbm_copy.ptx kvbm_copy.cu
sed -i -E 's/^\.version [0-9]+\.[0-9]+/.version 7.0/' kvbm_copy.ptx
nvcc -O3 -cubin -arch=sm_90 -Xptxas -v -o /tmp/kvbm_copy_sm90.cubin kvbm_copy.cu 2>&1 | grep -E 'registers|spill' || true
ls -l kvbm_copy.fatbin kvbm_copy.ptx
