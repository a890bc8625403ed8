//go:build cuda

package main

// This build copies G1 from GPU memory too (worker_cuda.go).
func init() { buildVariant = "cuda" }
