"""Benchmarks: `python -m specdec_core.bench` (prompts.py: plain against speculative decoding of a prompt set, any
device, real pairs; optionally beside llama.cpp), `python -m specdec_core.bench.gpu` (random weights of real shapes,
GPU costs), `python -m specdec_core.bench.startup` (the app's start-up)."""
