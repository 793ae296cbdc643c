"""Benchmarks of xkern against its peers on one GPU; `python -m benchmarks.main` runs them (see main.py)."""
