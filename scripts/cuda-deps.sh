#!/usr/bin/env bash
# Fetch what `make cuda` needs on a machine without a GPU: CUDA 11.8 headers
# (cuda.h) and the link stub libcuda.so from Debian bookworm's non-free
# nvidia-cuda-dev package. gorgonia.org/cu v0.9.6 compiles against 11.x
# headers, not 13.x (cuCtxCreate changed); the resulting library runs on a
# CUDA 13 driver. Only the .deb is downloaded (about 774 MB) and extracted;
# nothing is installed. Idempotent: a second run with the files present does
# nothing.
#
#   scripts/cuda-deps.sh [DEST]     DEST defaults to $CUDA_HOME or /opt/cuda-11.8-extract
#
# Afterwards: make cuda CUDA_HOME=DEST (headers in DEST/usr/include, stub in
# DEST/usr/lib/x86_64-linux-gnu/stubs).
set -euo pipefail

dest="${1:-${CUDA_HOME:-/opt/cuda-11.8-extract}}"
hdr="$dest/usr/include/cuda.h"
stub="$dest/usr/lib/x86_64-linux-gnu/stubs/libcuda.so"
if [[ -f "$hdr" && -f "$stub" ]]; then
  echo "cuda-deps: $hdr and $stub already present"
  exit 0
fi

# Debian's non-free component, same mirror and keyring as the default sources.
src=/etc/apt/sources.list.d/kvbm-non-free.sources
if ! grep -rqs 'non-free' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "cuda-deps: need root once to add Debian's non-free component ($src)" >&2
    exit 1
  fi
  . /etc/os-release
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s %s-updates\nComponents: contrib non-free\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$VERSION_CODENAME" "$VERSION_CODENAME" > "$src"
  apt-get update -q
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q nvidia-cuda-dev)
mkdir -p "$dest"
dpkg-deb -x "$work"/nvidia-cuda-dev_*.deb "$dest"
[[ -f "$hdr" && -f "$stub" ]] || { echo "cuda-deps: $hdr or $stub missing after extraction" >&2; exit 1; }
echo "cuda-deps: CUDA headers and link stub in $dest"
