"""Tuning and investigation tools (GPU or sm_90 compile on CPU): where the plans in xkern/ come from and the
probes still wanted. Not needed to reproduce the README's tables (that is benchmarks/)."""
