"""The user's entry points (train_gpt.py, megatron_gpt_example.py, show_parallel_groups.py) and,
in rooms of their own, the benchmarks (scripts/benchmarks), the CPU/GPU checks (scripts/checks)
and the maintainers' tools (scripts/tools). A package so that a script run by path imports a
shared helper or another room's script by its full name (``scripts._ranks``,
``scripts.checks.check_recompute_plan_cuda``) once the repository root is on ``sys.path``."""
