"""The CPU/GPU check scripts, and gpu_check.sh that runs them in steps
(docs/guides/gpu-checks.md)."""
