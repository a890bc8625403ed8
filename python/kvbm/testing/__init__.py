"""Helpers shared by kvbm's tests, benchmarks and demo: a locally generated random
model and a harness that runs vLLM (CPU backend) with or without kvbm."""
