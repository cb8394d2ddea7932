"""MXFP4 expert weights decoded on a GPU by one Triton kernel (the packed experts' `triton` decoder).

Each program reads a run of packed bytes and their scales once and writes the two values of each byte side by side,
low nibble first: the bytes read and written are those of the layout, with no index arithmetic per value beyond a
shift. The values are the decode tables' (mxfp4.decode_table) product in float32, rounded once to the weight's
dtype: the same bits as mxfp4.dequantize_mxfp4 and the compiled decoder.
"""
from __future__ import annotations

import functools

import torch

from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK, decode_table

BYTES_PER_PROGRAM = 2048  # packed bytes a program decodes (4,096 values)


@functools.cache
def available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA wheels, not with its CPU ones)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode(blocks_ptr, scales_ptr, values_ptr, powers_ptr, out_ptr, n_bytes,
               BYTES: tl.constexpr, BYTES_PER_SCALE: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BYTES
        offsets = start + tl.arange(0, BYTES)
        inside = offsets < n_bytes
        packed = tl.load(blocks_ptr + offsets, mask=inside, other=0).to(tl.int32)
        scale = tl.load(scales_ptr + offsets // BYTES_PER_SCALE, mask=inside, other=0).to(tl.int32)
        power = tl.load(powers_ptr + scale)
        low = tl.load(values_ptr + (packed & 0x0F)) * power
        high = tl.load(values_ptr + (packed >> 4)) * power
        values = tl.interleave(low, high).to(out_ptr.dtype.element_ty)
        out_offsets = 2 * start + tl.arange(0, 2 * BYTES)
        tl.store(out_ptr + out_offsets, values, mask=out_offsets < 2 * n_bytes)

    return decode


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] (uint8, on a GPU) -> the values [..., G * 32] in `dtype`, the
    on-disk orientation (mxfp4.dequantize_mxfp4's)."""
    *prefix, groups, per_group = blocks.shape
    if per_group != MXFP4_BLOCK // 2 or tuple(scales.shape) != (*prefix, groups):
        raise ValueError(f"blocks must be [..., G, {MXFP4_BLOCK // 2}] and scales [..., G]; got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    if blocks.device.type != "cuda" or not available():
        raise RuntimeError(f"the triton decoder runs on a GPU with Triton installed, got {blocks.device.type} tensors"
                           f"{'' if available() else ' and no Triton'}; the compiled and eager decoders run anywhere")
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*prefix, groups * MXFP4_BLOCK, dtype=dtype, device=blocks.device)
    values, powers = (decode_table(name, torch.float32, blocks.device) for name in ("fp4", "e8m0"))
    n_bytes = blocks.numel()
    grid = (-(-n_bytes // BYTES_PER_PROGRAM),)
    _kernel()[grid](blocks, scales, values, powers, out, n_bytes, BYTES=BYTES_PER_PROGRAM,
                    BYTES_PER_SCALE=MXFP4_BLOCK // 2)
    return out
