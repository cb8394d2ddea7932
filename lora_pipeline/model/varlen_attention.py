"""Attention over padding-free rows by PyTorch's own FlashAttention kernel for variable-length sequences
(torch.nn.attention.varlen), registered with transformers as the attention implementation `torch_varlen`."""
from __future__ import annotations

import inspect
import math

import torch

NAME = "torch_varlen"


def register() -> None:
    """Make `torch_varlen` a transformers attention implementation (idempotent). It is left out of transformers' mask
    functions on purpose: the model then builds no mask at all (a padding-free row needs none: the kernel reads each
    sequence's bounds from cu_seq_lens), and does not look for packed sequences in position_ids, which reads a value
    from the GPU in every forward."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, **kwargs):
    """transformers' attention-function interface: query [batch, heads, length, head_dim], key and value with the
    key-value heads; returns [batch, length, heads, head_dim]. The sequences are the ones TRL's padding-free collator
    marks (cu_seq_lens_q and max_length_q, computed on the CPU); without them each row is one causal sequence, which
    is right for training's right-padded rows (no real token sees the padding after it) and wrong for left-padded
    ones: generation and evaluation run sdpa instead (loading.inference_attention)."""
    batch, heads, length, head_dim = query.shape
    if dropout or sliding_window:
        raise ValueError(f"model.attn_implementation: {NAME} has no attention dropout and no sliding window (this "
                         f"model asks for dropout {dropout}, sliding window {sliding_window}); use flex_attention")
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:  # whole rows: boundaries every `length` tokens (no value read from the GPU)
        cu_seq_lens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
        max_length = length
    else:
        if batch != 1:
            raise ValueError(f"{NAME}: padding-free batches are one packed row, got {batch} rows")
        cu_seq_lens, max_length = cu_seq_lens.to(torch.int32), kwargs["max_length_q"]
    q = query.transpose(1, 2).reshape(batch * length, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], head_dim)
    scale = scaling if scaling is not None else head_dim ** -0.5
    out = causal_varlen_attention(q, k, v, cu_seq_lens, max_length, scale)
    return out.reshape(batch, length, heads, head_dim), None


_ACCEPTED: dict = {}


def _parameters(kernel) -> frozenset[str]:
    """The arguments a version of varlen_attn takes: read once in eager calls (not in every layer of every step),
    into the graph where torch.compile traces the call. Not functools.cache, which torch.compile warns of, nor the
    dict in a traced call: its entry, added there, would make every compiled layer compile a second time."""
    if torch.compiler.is_compiling():
        return frozenset(inspect.signature(kernel).parameters)
    if kernel not in _ACCEPTED:
        _ACCEPTED[kernel] = frozenset(inspect.signature(kernel).parameters)
    return _ACCEPTED[kernel]


def causal_varlen_attention(q, k, v, cu_seq_lens, max_length: int, scale: float):
    """torch.nn.attention.varlen.varlen_attn, causal, over torch's versions of it: 2.10 and 2.11 take is_causal, no
    scale and no grouped key-value heads; later versions take a window (-1, 0 is causal), a scale and enable_gqa."""
    from torch.nn.attention.varlen import varlen_attn

    accepted = _parameters(varlen_attn)
    options = {"window_size": (-1, 0)} if "window_size" in accepted else {"is_causal": True}
    if "scale" in accepted:
        options["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in accepted:
            options["enable_gqa"] = True
        else:  # each key-value head repeated for its group of query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)


def reference_varlen_attention(q, k, v, cu_seq_lens, max_length: int, scale: float):
    """The same attention by sdpa, one sequence at a time: the pure-torch reference (any device, any dtype)."""
    bounds = cu_seq_lens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seq = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, length, head_dim]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            *seq, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1))
    return torch.cat(outs)
