"""The machinery behind the parallel linear layers (private; megatron-core has no such module).

ColumnParallelLinear and RowParallelLinear live in ``layers.py`` and the inference layers in
``inference_layers.py``, megatron-core's paths, which re-export the public names built here. The
family, each file one idea:

* base.py: ``_ParallelLinearBase``, what both linear layers share (the tensor-parallel group and
  sizes, weight creation, which linear function runs, ``_extra_state``, ``sharded_state_dict``)
  and the expert-parameter gradient rule the switch selects (``set_expert_grad_rule``).
* autograd.py: ``linear_with_grad_accumulation_and_async_allreduce`` and its autograd function,
  the overlapped backward and the fused weight gradient (NOTE [ Overlapped linear backward ]).
* frozen.py: ``linear_with_frozen_weight``, the linear function for a weight that needs no
  gradient.
* delayed_wgrad.py: ``WgradStore``, the weight gradient computed later by ``backward_dw()``
  (NOTE [ Delayed weight gradient ]).
* amp.py: ``custom_fwd`` / ``custom_bwd``, backward under forward's autocast state, for any
  device type (NOTE [ Autocast in autograd functions ]).
* inference.py: ``InferenceLinear``, megatron-core 0.19's inference version of TE's TELinear
  (served by ``inference_layers.py``).

This face imports nothing: each public name has one path, megatron-core's (``layers.py``,
``inference_layers.py``), and importing one module here (``amp.py``, say) loads only what that
module needs.
"""

__all__: list[str] = []
