"""Load tests and benchmarks, each runnable as ``python -m loadtest.<name>``.

Figures are ratios to what this machine does without storaged (raw libraries, loopback,
memcpy) measured in the same run; docs/BENCHMARKS.md records them with their commands.
"""
