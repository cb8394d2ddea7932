"""Attention over padding-free rows by PyTorch's own FlashAttention kernel for variable-length sequences
(torch.nn.attention.varlen; gpt-oss's sinks and sliding window through the kernel's own operators), registered with
transformers as the attention implementation `torch_varlen`."""
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
                             sliding_window=None, s_aux=None, **kwargs):
    """transformers' attention-function interface: query [batch, heads, length, head_dim], key and value with the
    key-value heads; returns [batch, length, heads, head_dim]. The sequences are the ones TRL's padding-free collator
    marks (cu_seq_lens_q and max_length_q, computed on the CPU); without them each row is one causal sequence, which
    is right for training's right-padded rows (no real token sees the padding after it) and wrong for left-padded
    ones: generation and evaluation run sdpa or eager instead (loading.inference_attention). gpt-oss's attention
    sinks (s_aux) and sliding window run as sink_varlen_attention."""
    batch, heads, length, head_dim = query.shape
    if dropout:
        raise ValueError(f"model.attn_implementation: {NAME} has no attention dropout (this model asks for "
                         f"{dropout}); use flex_attention")
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
    if s_aux is None and not sliding_window:
        out = causal_varlen_attention(q, k, v, cu_seq_lens, max_length, scale)
    else:
        sinks = s_aux if s_aux is not None else q.new_full((heads,), float("-inf"))
        out = sink_varlen_attention(q, k, v, sinks, cu_seq_lens, max_length, scale, sliding_window or 0)
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
    """causal_varlen_attention by the reference pair's forward: the pure-torch reference (any device, any dtype)."""
    return reference_flash_forward(q, k, v, cu_seq_lens, scale, -1)[0]


def sink_varlen_attention(q, k, v, sinks, cu_seq_lens, max_length: int, scale: float, sliding_window: int = 0):
    """Causal attention over packed sequences with one learned sink per query head (a logit in each softmax's
    denominator with no value: gpt-oss), each query seeing at most `sliding_window` keys, itself included (0: all
    before it). q [tokens, heads, head_dim], k and v [tokens, key-value heads, head_dim], sinks [heads]."""
    return _SinkAttention.apply(q, k, v, sinks, cu_seq_lens, max_length, scale, sliding_window - 1)


class _SinkAttention(torch.autograd.Function):
    """FlashAttention's forward and backward with the sinks folded in around them. A sink only grows each softmax's
    denominator, so the output is the kernel's times exp(lse - lse_with_sink), lse_with_sink = logaddexp(lse, sink).
    The kernel's backward recomputes the probabilities from the log-sum-exp it is given and each row's
    sum(grad_out * out) from the output: given lse_with_sink and the scaled output, it returns the gradients of the
    attention with sinks (the sink's value is zero, so it adds nothing to the keys' and values' gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seq_lens, max_length, scale, window_left):
        out, lse = flash_forward(q, k, v, cu_seq_lens, max_length, scale, window_left)  # lse [heads, tokens]
        lse_with_sinks = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
        out = (out.to(lse.dtype) * torch.exp(lse - lse_with_sinks).T[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, cu_seq_lens, out, lse_with_sinks)
        ctx.max_length, ctx.scale, ctx.window_left = max_length, scale, window_left
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, cu_seq_lens, out, lse_with_sinks = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = flash_backward(grad_out, q, k, v, out, lse_with_sinks, cu_seq_lens, ctx.max_length, ctx.scale,
                                    ctx.window_left)
        dsinks = None
        if ctx.needs_input_grad[3]:  # d loss / d sink = -sum over queries of p(sink) * sum(grad_out * out)
            wide = lse_with_sinks.dtype
            grad_dot_out = (grad_out.to(wide) * out.to(wide)).sum(-1).T  # [heads, tokens]
            dsinks = -(torch.exp(sinks.to(wide)[:, None] - lse_with_sinks) * grad_dot_out).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def flash_forward(q, k, v, cu_seq_lens, max_length: int, scale: float, window_left: int):
    """(output, log-sum-exp [heads, tokens]) of causal attention over packed sequences, each query seeing the
    `window_left` keys before it (-1: all). On a GPU torch's FlashAttention kernel; elsewhere the reference."""
    if not q.is_cuda:
        return reference_flash_forward(q, k, v, cu_seq_lens, scale, window_left)
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, 0.0, True, False, scale=scale,
        window_size_left=window_left, window_size_right=0)[:2]
    return out, lse


def flash_backward(grad_out, q, k, v, out, lse, cu_seq_lens, max_length: int, scale: float, window_left: int):
    """(dq, dk, dv) of flash_forward's attention, recomputed from `out` and `lse` as FlashAttention's backward does."""
    if not q.is_cuda:
        return reference_flash_backward(grad_out, q, k, v, out, lse, cu_seq_lens, scale, window_left)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seq_lens, cu_seq_lens, max_length, max_length, 0.0, True, unused, unused,
        scale=scale, window_size_left=window_left, window_size_right=0)


def _sequence_scores(q, k, scale: float, window_left: int):
    """Causal (and windowed) scores of one sequence in float32 or wider, key-value heads repeated:
    [heads, queries, keys]."""
    wide = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(wide), k.to(wide)) * scale
    position = torch.arange(q.shape[0], device=q.device)
    behind = position[:, None] - position[None, :]
    allowed = (behind >= 0) & ((behind <= window_left) if window_left >= 0 else True)
    return scores.masked_fill(~allowed, float("-inf"))


def reference_flash_forward(q, k, v, cu_seq_lens, scale: float, window_left: int):
    """flash_forward in float32 (or wider) torch, one sequence at a time: the reference (any device)."""
    bounds = cu_seq_lens.tolist()
    outs, lses = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        scores = _sequence_scores(q[start:end], k[start:end], scale, window_left)
        lse = torch.logsumexp(scores, dim=-1)  # [heads, queries]
        values = v[start:end].to(scores.dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), values))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def reference_flash_backward(grad_out, q, k, v, out, lse, cu_seq_lens, scale: float, window_left: int):
    """flash_backward in float32 (or wider) torch, as FlashAttention computes it: the probabilities from the given
    lse, each query's sum(grad_out * out) from the given output; the gradients of repeated key-value heads summed."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seq_lens.tolist()
    dqs, dks, dvs = [], [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = slice(start, end)
        probs = torch.exp(_sequence_scores(q[rows], k[rows], scale, window_left) - lse[:, rows, None])
        grad, values, keys = (t[rows].to(probs.dtype) for t in (grad_out, v, k))
        values, keys = (t.repeat_interleave(groups, dim=1) for t in (values, keys))
        grad_probs = torch.einsum("qhd,khd->hqk", grad, values)
        grad_dot_out = (grad * out[rows].to(probs.dtype)).sum(-1).T  # [heads, queries]
        grad_scores = probs * (grad_probs - grad_dot_out[..., None]) * scale
        dqs.append(torch.einsum("hqk,khd->qhd", grad_scores, keys))
        dk = torch.einsum("hqk,qhd->khd", grad_scores, q[rows].to(probs.dtype))
        dv = torch.einsum("hqk,qhd->khd", probs, grad)
        dks.append(dk.unflatten(1, (k.shape[1], groups)).sum(2))
        dvs.append(dv.unflatten(1, (v.shape[1], groups)).sum(2))
    return torch.cat(dqs).to(q.dtype), torch.cat(dks).to(k.dtype), torch.cat(dvs).to(v.dtype)
