"""``transformer_engine.pytorch.attention.rope``: rotary position embeddings.

megatron-core's ``apply_rope_fusion`` (on by default in Megatron-LM) calls
``apply_rotary_pos_emb(..., fused=True)`` for sbhd and THD inputs. The stand-in's "fused" path
is the same rotation computed in fp32 and rounded once to the input's dtype, which is what
Transformer Engine's fused kernel computes; ``fused=False`` is Transformer Engine's unfused
formula (cos and sin rounded to the input's dtype first). In fp32 both equal megatron-core's own
unfused RoPE.
"""

from __future__ import annotations

import torch

from megatron_core import device
from megatron_core.errors import MegatronCoreError

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]

_FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """The rotary frequencies table [s, 1, 1, dim] (Su et al., RoFormer).

    Args:
        dim: the rotary dimension (before ``rotary_percent``).
        rotary_percent: the fraction of ``dim`` that rotates.
        seq_len_interpolation_factor: divide positions by it (position interpolation).
        pretrained_max_position_embeddings: with the factor, the trained length beyond which the
            scaling follows the sequence length.
        rotary_base: the base of the inverse frequencies.
        interleaved: pair dimensions (2i, 2i+1) instead of (i, i + d/2).
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: int | None = None,
        pretrained_max_position_embeddings: int | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device=device.current_device())
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** (steps / dim)))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """The frequencies of positions offset .. offset + max_seq_len - 1, [s, 1, 1, dim]."""
        with torch.autocast(self.inv_freq.device.type, enabled=False):
            seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32)
            seq = seq + offset
            factor = self.seq_len_interpolation_factor
            if self.pretrained_max_position_embeddings is not None and factor is not None:
                if max_seq_len > self.pretrained_max_position_embeddings * factor:
                    seq = seq * (self.pretrained_max_position_embeddings / max_seq_len)
                else:
                    seq = seq / factor
            freqs = torch.outer(seq, self.inv_freq)
        if self.interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """(-x2, x1) of the two halves, or of the odd / even elements when interleaved."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return rotated.reshape(x.shape)


def _freqs_on_cp_rank(freqs: torch.Tensor, seqlen: int, cp_size: int, cp_rank: int):
    """The rows of ``freqs`` for this context-parallel rank's two chunks of a sequence split in
    2 cp chunks (megatron's load-balanced order); the first ``seqlen`` rows without CP."""
    if cp_size == 1:
        return freqs[:seqlen]
    half, full = seqlen // 2, cp_size * seqlen
    return torch.cat(
        [
            freqs[cp_rank * half : (cp_rank + 1) * half],
            freqs[full - (cp_rank + 1) * half : full - cp_rank * half],
        ]
    )


def _rotate(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, fused: bool):
    """t * cos + rotate(t) * sin on the first freqs.shape[-1] channels of ``t``."""
    rot_dim = freqs.shape[-1]
    rot, rest = t[..., :rot_dim], t[..., rot_dim:]
    if fused:  # fp32 throughout, one rounding (the fused kernel's arithmetic)
        freqs, x = freqs.float(), rot.float()
        out = (x * freqs.cos() + _rotate_half(x, interleaved) * freqs.sin()).to(t.dtype)
    else:
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        out = rot * cos + _rotate_half(rot, interleaved) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Rotate ``t`` by the rotary frequencies ``freqs`` (Transformer Engine's signature).

    Args:
        t: [s, b, h, d] ("sbhd"), [b, s, h, d] ("bshd") or [t, h, d] packed sequences ("thd").
        freqs: [s2, 1, 1, d2] (or [s2, b, 1, d2]) float frequencies, s2 >= s and d2 <= d; the
            first d2 channels rotate, the rest pass.
        tensor_format: the layout of ``t``.
        start_positions: [b] position offsets (sequence i uses rows start_positions[i]..).
        interleaved: rotate (2i, 2i+1) pairs instead of (i, i + d2/2).
        fused: compute in fp32 and round once (the fused kernel); else Transformer Engine's
            unfused formula.
        cu_seqlens: [b + 1] cumulative sequence lengths ("thd"; with CP the padded ones).
        cp_size, cp_rank: context parallelism: this rank holds chunks r and 2 cp - 1 - r of
            every sequence.

    Returns:
        ``t`` rotated, same shape and dtype.

    Raises:
        MegatronCoreError: an unknown format, "thd" without ``cu_seqlens``, or frequencies
            shorter than a sequence.
    """
    if tensor_format not in _FORMATS:
        raise MegatronCoreError(
            f"apply_rotary_pos_emb: tensor_format ({tensor_format!r}) not in {_FORMATS}"
        )
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise MegatronCoreError("apply_rotary_pos_emb: tensor_format 'thd' needs cu_seqlens")
        lengths = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
        pieces = []
        for i, x in enumerate(torch.split(t, lengths)):
            table = freqs[int(start_positions[i]) :] if start_positions is not None else freqs
            table = _freqs_on_cp_rank(table, x.size(0), cp_size, cp_rank)
            pieces.append(_rotate(x.unsqueeze(1), table, interleaved, fused).squeeze(1))
        return torch.cat(pieces)
    seqlen = t.size(0) if tensor_format == "sbhd" else t.size(1)
    if freqs.size(0) < seqlen * cp_size:
        raise MegatronCoreError(
            f"apply_rotary_pos_emb: freqs has {freqs.size(0)} positions, the sequence "
            f"{seqlen * cp_size}"
        )
    if start_positions is not None:
        freqs = torch.cat([freqs[int(p) : int(p) + seqlen * cp_size] for p in start_positions], 1)
    freqs = _freqs_on_cp_rank(freqs, seqlen, cp_size, cp_rank)
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    return _rotate(t, freqs, interleaved, fused)
