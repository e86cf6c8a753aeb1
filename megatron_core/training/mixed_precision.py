"""Megatron-style mixed precision for the main job: bf16/fp16 model, fp32 main grads and weights.

NOTE [ Mixed precision ]
1. Model. ``--bf16`` / ``--fp16`` build the model with ``params_dtype`` bf16 / fp16, so weights
   and activations are half precision; attention softmax and the vocab-parallel cross entropy
   compute in fp32 (the loss is fp32). The weights start as the fp32 model's draw rounded
   (``layer_params.init_from_fp32_draw``: torch's own half draws differ by release).
2. Main grads. Every model parameter gets an fp32 ``param.main_grad`` buffer. The parallel
   linear layers add their weight gradient into it directly (``gradient_accumulation_fusion``:
   apex's kernel on CUDA, else torch's addmm in fp32, see tensor_parallel/linear/autograd.py);
   every other gradient (biases, LayerNorm, embeddings) is added into it by a
   post-accumulate-grad hook, which then frees the half-precision ``.grad``. Microbatches
   therefore accumulate in fp32.
3. Main weights. The wrapped torch optimizer steps fp32 copies of the parameters (the "main"
   or "master" weights), whose ``.grad`` is the main_grad buffer. After the step the model's
   parameters are set to the main weights rounded to the model dtype. Gradient reductions
   (finalize_model_grads reads ``main_grad`` where it exists) and clipping run on the fp32 main
   grads (:meth:`MixedPrecisionOptimizer.prepare_grads` returns a module holding the main
   weights, so the loop's clipping takes it like the model).
4. fp16 loss scaling. The loss is multiplied by the scale before backward; ``prepare_grads``
   divides the main grads by it. :meth:`MixedPrecisionOptimizer.step` looks for inf/nan in the
   main grads of every rank (one all-reduce over the world, so every rank decides alike), skips
   the update if there is one, and lets :class:`DynamicLossScaler` shrink or grow the scale
   (megatron's rules: back off after ``hysteresis`` overflows, grow after ``growth_interval``
   clean steps). Skipped iterations are counted.
5. State. :meth:`MixedPrecisionOptimizer.state_dict` is the wrapped optimizer's state dict (its
   ``state`` / ``param_groups``, indexed over the main weights in model order) plus
   ``main_params`` (name -> fp32 main weight, named like ``model.named_parameters()``) and
   ``loss_scaler``. Loading it restores the main weights bitwise, so a resumed run continues
   exactly where the saved run was, not from the rounded half-precision model weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import consistency
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

__all__ = ["DynamicLossScaler", "MixedPrecisionOptimizer", "HALF_DTYPES"]

HALF_DTYPES = (torch.bfloat16, torch.float16)


class DynamicLossScaler:
    """fp16 dynamic loss scale (megatron's DynamicGradScaler rules; NOTE rule 4).

    Args:
        initial_scale: the first scale.
        min_scale: the scale never goes below this.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps.
        backoff_factor: multiply the scale by this after ``hysteresis`` overflows.
        growth_interval: clean steps before growing.
        hysteresis: overflows tolerated before backing off (reset by a grow).

    Raises:
        MegatronCoreError: a non-positive scale, a factor on the wrong side of 1, or an interval
            or hysteresis below 1.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        if not 0 < min_scale <= initial_scale:
            raise MegatronCoreError(
                f"loss scaler: need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale})"
            )
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise MegatronCoreError(
                f"loss scaler: growth_factor ({growth_factor}) must be > 1 and backoff_factor "
                f"({backoff_factor}) in (0, 1)"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise MegatronCoreError(
                f"loss scaler: growth_interval ({growth_interval}) and hysteresis ({hysteresis}) "
                "must be >= 1"
            )
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor = float(min_scale), float(growth_factor)
        self.backoff_factor, self.growth_interval = float(backoff_factor), int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._clean_steps, self._hysteresis_left = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step: shrink after ``hysteresis`` overflows, grow after a clean run."""
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps, self._hysteresis_left = 0, self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        """The scale and the counters (plain numbers)."""
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def _fold_grad_into_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: NOTE [ Mixed precision ], rule 2."""
    if param.grad is None:  # the fused linear wgrad went into main_grad directly
        return
    param.main_grad.add_(param.grad)
    param.grad = None


class MixedPrecisionOptimizer:
    """A torch optimizer stepping fp32 main weights of a bf16/fp16 model (NOTE rules 2-5).

    Args:
        optimizer: a torch optimizer built over ``model``'s (half-precision) parameters. Its
            parameter groups are re-pointed at fp32 main weights; keep using this wrapper.
        model: the model; its parameters get ``main_grad`` buffers and grad hooks.
        loss_scaler: a DynamicLossScaler (fp16), or None (bf16: no scaling).

    Attributes:
        skipped_iterations: steps skipped because of inf/nan gradients (fp16).
        last_step_skipped: whether the latest :meth:`step` skipped the update.

    Raises:
        MegatronCoreError: a parameter of the optimizer that is not in ``model``, or a
            parameter that is not bf16/fp16.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss_scaler=None):
        self.optimizer, self.loss_scaler = optimizer, loss_scaler
        names = {id(p): name for name, p in model.named_parameters()}
        self._model_params, self._names, main = [], [], []
        for group in optimizer.param_groups:
            mains = []
            for param in group["params"]:
                if id(param) not in names or param.dtype not in HALF_DTYPES:
                    raise MegatronCoreError(
                        f"MixedPrecisionOptimizer: parameter of shape {tuple(param.shape)}, dtype "
                        f"{param.dtype} must be a bf16/fp16 parameter of the model"
                    )
                master = torch.nn.Parameter(param.detach().float())
                copy_tensor_model_parallel_attributes(master, param)
                for attribute in ("sequence_parallel", "shared"):  # read by finalize/clip
                    setattr(master, attribute, getattr(param, attribute, False))
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
                param.register_post_accumulate_grad_hook(_fold_grad_into_main_grad)
                self._model_params.append(param)
                self._names.append(names[id(param)])
                mains.append(master)
            group["params"] = mains
            main += mains
        self.main_module = torch.nn.ParameterList(main)
        self.skipped_iterations, self.last_step_skipped = 0, False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (over the fp32 main weights); set ``lr`` here."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 main_grad buffers; drop model and main-weight ``.grad``."""
        for param, master in zip(self._model_params, self.main_module):
            param.main_grad.zero_()
            param.grad = None
            master.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (``loss`` itself without a scaler); backward this."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def prepare_grads(self) -> torch.nn.Module:
        """Point each main weight's ``.grad`` at its fp32 main_grad, unscaled (rule 3-4).

        Returns:
            A module whose parameters are the main weights (with TP/SP attributes), for the
            data-parallel average and clipping.
        """
        inverse = 1.0 / self.loss_scale
        for param, master in zip(self._model_params, self.main_module):
            if param.grad is not None:  # a grad the hook did not see (e.g. set by hand)
                _fold_grad_into_main_grad(param)
            if inverse != 1.0:
                param.main_grad.mul_(inverse)
            master.grad = param.main_grad
        return self.main_module

    def _found_inf(self) -> bool:
        flags = [torch.logical_not(torch.isfinite(m.grad).all()) for m in self.main_module]
        found = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1)
        if dist.is_initialized():
            # every rank skips alike (rule 4)
            consistency.checked_all_reduce("found inf all_reduce", found, None, dist.ReduceOp.MAX)
        return bool(found.item())

    def step(self) -> bool:
        """Step the main weights (unless fp16 gradients overflowed) and copy them to the model.

        Call after :meth:`prepare_grads` (and any clipping). With a loss scaler this runs one
        all-reduce over the world on every rank.

        Returns:
            True if the update was applied, False if it was skipped.
        """
        skipped = self.loss_scaler is not None and self._found_inf()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        self.last_step_skipped = skipped
        if skipped:
            self.skipped_iterations += 1
            return False
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self._model_params, self.main_module):
                param.copy_(master)
        return True

    # The hooks of the training checkpoint (NOTE [ Checkpoint keys ], rule 4, in
    # training/checkpoint_state.py): main weights saved cut like their parameters, the loss
    # scaler as extra tensors.
    def checkpoint_param_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its fp32 main weight) for every parameter this optimizer steps."""
        return list(zip(self._model_params, self.main_module))

    def checkpoint_extra_state(self) -> dict[str, torch.Tensor]:
        """The loss scaler's state and the skipped-iteration count as fp64 scalars ({} for bf16)."""
        if self.loss_scaler is None:
            return {}
        values = {**self.loss_scaler.state_dict(), "skipped_iterations": self.skipped_iterations}
        return {f"loss_scaler.{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in
                values.items()}  # fmt: skip

    def load_checkpoint_extra_state(self, extra: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`checkpoint_extra_state`'s tensors.

        Raises:
            MegatronCoreError: the checkpoint has a loss scaler and this run has none (or the
                other way round).
        """
        values = {k.removeprefix("loss_scaler."): float(v) for k, v in extra.items()}
        if (not values) != (self.loss_scaler is None):
            raise MegatronCoreError(
                f"MixedPrecisionOptimizer: checkpoint loss scaler state {sorted(values)}, this "
                f"run {'has none' if self.loss_scaler is None else 'uses --fp16'} (--fp16 and "
                "--bf16 checkpoints do not mix)"
            )
        if self.loss_scaler is not None:
            self.skipped_iterations = int(values.pop("skipped_iterations", 0))
            self.loss_scaler.load_state_dict(values)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``main_params`` and ``loss_scaler`` (rule 5)."""
        state = self.optimizer.state_dict()
        state["main_params"] = {
            name: master.detach().clone() for name, master in zip(self._names, self.main_module)
        }
        state["loss_scaler"] = None if self.loss_scaler is None else self.loss_scaler.state_dict()
        state["skipped_iterations"] = self.skipped_iterations
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result: optimizer state, main weights, loss scale.

        Raises:
            MegatronCoreError: the main weights' names or shapes differ from this model's, or
                the saved run used a loss scaler and this one does not (or vice versa).
        """
        saved = state.get("main_params")
        if saved is None or set(saved) != set(self._names):
            got = None if saved is None else sorted(saved)[:4]
            raise MegatronCoreError(
                f"MixedPrecisionOptimizer: checkpoint main_params {got} do not match the model's "
                f"parameters ({sorted(self._names)[:4]} ...); was it saved without --bf16/--fp16?"
            )
        if (state.get("loss_scaler") is None) != (self.loss_scaler is None):
            raise MegatronCoreError(
                f"MixedPrecisionOptimizer: checkpoint loss_scaler is {state.get('loss_scaler')}, "
                f"this run's is {self.loss_scaler and self.loss_scaler.state_dict()} "
                "(--fp16 and --bf16 checkpoints do not mix)"
            )
        for name, master in zip(self._names, self.main_module):
            if saved[name].shape != master.shape:
                raise MegatronCoreError(
                    f"MixedPrecisionOptimizer: main weight {name} is {list(saved[name].shape)} in "
                    f"the checkpoint, {list(master.shape)} here"
                )
        inner = {k: v for k, v in state.items() if k in ("state", "param_groups")}
        self.optimizer.load_state_dict(inner)
        with torch.no_grad():
            for name, param, master in zip(self._names, self._model_params, self.main_module):
                master.copy_(saved[name])
                param.copy_(master)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.skipped_iterations = int(state.get("skipped_iterations", 0))
