"""The recompute planner's public names at the path they were first served from
(``from megatron_core.tensor_parallel.recompute.plan import plan_recompute``): the same objects
as :mod:`megatron_core.tensor_parallel.recompute.planner`, where the planner lives (NOTE
[ Recompute planner ] in its face)."""

from megatron_core.tensor_parallel.recompute.planner import *  # noqa: F403 (the face's names)
from megatron_core.tensor_parallel.recompute.planner import __all__  # noqa: F401
