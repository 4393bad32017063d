"""Op and model benchmarks (see harness.py). Run from the repository root,
as files (``python benchmarks/bench_rms_norm.py``) or as modules
(``python -m benchmarks.bench_rms_norm``)."""
