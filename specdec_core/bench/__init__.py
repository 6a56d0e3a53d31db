"""Benchmarks: `python -m specdec_core.bench` (CPU or any device, real pairs) and
`python -m specdec_core.bench.gpu` (random weights of real shapes, GPU costs)."""
