"""The benchmark scripts: each measures side by side in one run; docs/benchmarks/ quotes them."""
