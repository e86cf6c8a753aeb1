"""Cross entropy over logits split along the vocabulary (the output of a vocab-parallel layer).

Each rank holds ``[..., V / tp]`` logits for its vocabulary range (see :class:`VocabUtility`). The
loss needs three numbers per token from the whole vocabulary, and each is a sum or a max of
per-rank values, so no rank ever materializes the full vocabulary:

1. ``m = max_j z_j`` (all-reduce MAX), subtracted from the logits for numerical stability;
2. ``z_t - m``, the target's shifted logit, contributed by the rank that owns the target;
3. ``sum_j exp(z_j - m)`` and, with label smoothing, ``sum_j (z_j - m)`` (one all-reduce SUM).

With ``lse = log(sum_j exp(z_j - m))`` and ``label_smoothing = e`` over ``V`` classes, the loss is
megatron-core's: the target keeps ``1 - e`` of the probability mass and every other class gets
``e / (V - 1)``. Written with ``s = e * V / (V - 1)`` this is
``(1 - s) * (lse - (z_t - m)) + s * (lse - sum_j (z_j - m) / V)`` -- torch's
``F.cross_entropy(..., label_smoothing=s)`` -- and its gradient is
``softmax_j - (1 - s) * [j == t] - s / V``, computed from this rank's slice only. Tokens whose
target is ``ignore_index`` (a keyword-only extension; megatron-core has none) get loss 0 and
gradient 0. All arithmetic is fp32. With ``label_smoothing = 0`` it is plain cross entropy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_core import consistency
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import get_tensor_model_parallel_group  # looked up per call
from megatron_core.parallel_state.handed import all_reduce_in_place
from megatron_core.tensor_parallel.utils import VocabUtility

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]


def _check(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise MegatronCoreError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the "
            f"logits shape {tuple(logits.shape)} without its last (vocabulary) dimension"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool or target.is_complex():
        raise MegatronCoreError(
            f"vocab_parallel_cross_entropy: target dtype ({target.dtype}) must be an integer type"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise MegatronCoreError(
            f"vocab_parallel_cross_entropy: label_smoothing ({label_smoothing}) must be in [0, 1)"
        )
    if logits.size(-1) < 1:
        raise MegatronCoreError(
            f"vocab_parallel_cross_entropy: the vocabulary partition is empty (logits shape "
            f"{tuple(logits.shape)})"
        )


class VocabParallelCrossEntropy:
    """megatron-core's building blocks of vocab-parallel cross entropy (its fused and unfused
    implementations call them in this order); local tensor math, no communication.

    The caller all-reduces (MAX) ``logits_max`` after :meth:`calculate_logits_max` and (SUM)
    ``predicted_logits`` and ``sum_exp_logits`` after :meth:`calculate_predicted_logits`. These
    follow megatron-core exactly, including updating the fp32 logits in place;
    :func:`vocab_parallel_cross_entropy` is this package's own implementation (torch's label
    smoothing and ``ignore_index``, see the module doc).
    """

    @staticmethod
    def calculate_logits_max(
        vocab_parallel_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits as fp32 [..., V/tp], their max over this rank's vocabulary [...])."""
        logits = vocab_parallel_logits.float()
        return logits, logits.max(dim=-1)[0]

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shift by the global max and exponentiate, in place in ``vocab_parallel_logits``.

        Returns:
            (target_mask [...]: True where the target is outside this rank's range,
            masked_target_1d [N]: the local target index (0 where masked),
            predicted_logits [...]: the target's shifted logit (0 where masked),
            sum_exp_logits [...]: this rank's sum of exp, exp_logits: the updated logits).
        """
        vocab_parallel_logits.sub_(logits_max.unsqueeze(-1))
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target - vocab_start_index).masked_fill(target_mask, 0)
        logits_2d = vocab_parallel_logits.view(-1, vocab_parallel_logits.size(-1))
        masked_target_1d = masked_target.reshape(-1)
        rows = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[rows, masked_target_1d].view_as(target).clone()
        predicted_logits.masked_fill_(target_mask, 0.0)
        exp_logits = vocab_parallel_logits.exp_()
        return target_mask, masked_target_1d, predicted_logits, exp_logits.sum(dim=-1), exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(softmax, normalized in place in ``exp_logits``; loss = log(sum exp) - predicted)."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        return exp_logits.div_(sum_exp_logits.unsqueeze(-1)), loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad_2d: ``softmax`` viewed [N, V/tp], arange over N, 1 - target_mask as fp32 [N],
        grad_input: ``softmax`` itself, which the gradient overwrites)."""
        grad_2d = softmax.view(-1, softmax.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
        return grad_2d, rows, 1.0 - target_mask.reshape(-1).float(), softmax

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """softmax - onehot(target) (this rank's part), times ``grad_output``; in place."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input.mul_(grad_output.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy. Forward: a max all-reduce, then one sum all-reduce of per-token
    partial results (module doc). Backward: local, this rank's softmax minus the target terms."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, ignore_index, group):
        # The group's own size() and rank(): a process group, or an object megatron-core 0.19
        # accepts in its place (its unit tests pass one with rank() and size()).
        world_size, rank = group.size(), group.rank()
        partition = vocab_parallel_logits.size(-1)
        vocab_size = partition * world_size
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition, rank, world_size
        )
        if label_smoothing > 0:
            # megatron-core's convention: e / (V - 1) on each non-target class (module doc).
            label_smoothing = label_smoothing * vocab_size / max(vocab_size - 1, 1)
        ignored = target == ignore_index
        # Targets may differ between ranks (a user error): a rank that finds a bad one shares
        # it, so every rank raises and none waits in the all-reduce below (NOTE [ Agree before
        # acting ] in consistency/checks.py, rule 4). The same exchange compares the logits'
        # shape and dtype and the target's shape, in every mode (it runs anyway): the
        # all-reduces below are sized by them, and sizes that differ abort gloo.
        if world_size > 1:
            agreed = consistency.agreed_errors(
                "vocab_parallel_cross_entropy", group, vocab_parallel_logits,
                target_shape=tuple(target.shape), ignore_index=ignore_index,
            )  # fmt: skip
        else:  # one rank: nothing to share, and no exchange to make
            agreed = contextlib.nullcontext()
        with agreed:
            if bool((((target < 0) | (target >= vocab_size)) & ~ignored).any()):
                bad = target[((target < 0) | (target >= vocab_size)) & ~ignored]
                raise MegatronCoreError(
                    f"vocab_parallel_cross_entropy: target values {bad.unique()[:8].tolist()} "
                    f"are outside [0, vocab size ({vocab_size})) and differ from ignore_index "
                    f"({ignore_index})"
                )

        logits = vocab_parallel_logits.float()
        logits_max = logits.max(dim=-1)[0]
        if world_size > 1:
            all_reduce_in_place(logits_max, dist.ReduceOp.MAX, group)  # handed: NOTE in handed.py
        shifted = logits - logits_max.unsqueeze(-1)

        owned = (target >= first) & (target < last) & ~ignored
        local_target = torch.where(owned, target - first, torch.zeros_like(target)).long()
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~owned, 0.0)
        logit_sum = shifted.sum(dim=-1) if label_smoothing > 0 else torch.zeros_like(target_logit)
        exp_logits = shifted.exp_()  # `shifted` is ours and no longer needed
        stats = torch.stack([target_logit, exp_logits.sum(dim=-1), logit_sum])
        if world_size > 1:
            all_reduce_in_place(stats, dist.ReduceOp.SUM, group)
        target_logit, sum_exp, logit_sum = stats.unbind(0)

        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            smooth = log_sum_exp - logit_sum / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, owned, ignored)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.logits_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, local_target, owned, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()  # keep the saved tensor intact (backward may run twice)
        grad.scatter_add_(
            -1, local_target.unsqueeze(-1), -(1.0 - eps) * owned.unsqueeze(-1).float()
        )
        if eps > 0:
            grad.sub_(eps / ctx.vocab_size)
        grad.mul_(grad_output.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocab-parallel logits, as torch computes it on the full logits.

    Matches megatron-core's ``vocab_parallel_cross_entropy``: without smoothing,
    ``torch.nn.functional.cross_entropy(full_logits.flatten(0, -2), target.flatten(),
    ignore_index=ignore_index, reduction="none")`` reshaped to ``target.shape``; with smoothing
    ``e``, the same with torch's ``label_smoothing=e * V / (V - 1)`` (module doc); computed in fp32.

    Args:
        vocab_parallel_logits: ``[..., V / tp]``, this rank's slice of the vocabulary (rank order).
        target: ``[...]`` global token ids in ``[0, V)`` or ``ignore_index``; the same on every
            rank of the group.
        label_smoothing: probability mass the target gives up, spread as ``e / (V - 1)`` over the
            other classes (megatron-core's convention), in [0, 1).
        tp_group: (megatron-core 0.19) the process group splitting the vocabulary; default the
            tensor-model-parallel group.
        ignore_index: target value whose tokens get loss 0 and gradient 0 (torch's default -100).
        group: this package's older keyword for ``tp_group`` (give at most one of them).

    Returns:
        The fp32 loss of every token, shape ``target.shape``.

    Raises:
        MegatronCoreError: for mismatched shapes, a non-integer target, a target outside the
            vocabulary, or label_smoothing outside [0, 1).
    """
    if tp_group is not None and group is not None and tp_group is not group:
        raise MegatronCoreError(
            "vocab_parallel_cross_entropy: tp_group and group name different groups; give one"
        )
    group = tp_group if group is None else group
    group = get_tensor_model_parallel_group() if group is None else group
    if group.size() > 1:
        consistency.check_collective(
            "vocab_parallel_cross_entropy", group, vocab_parallel_logits, content=target,
            target_shape=tuple(target.shape), label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )  # fmt: skip
    _check(vocab_parallel_logits, target, label_smoothing)
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, float(label_smoothing), int(ignore_index), group
    )
