"""MXFP4 (OCP MX e2m1) encode and decode in pure torch, in the layout transformers reads."""

from __future__ import annotations

import torch

__all__ = [
    "FP4_VALUES",
    "E8M0_BIAS",
    "MXFP4_BLOCK",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "decode_table",
]

# e2m1 code -> value; code bit 3 is the sign. Same table (and order) as transformers.integrations.mxfp4.FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Values per shared scale (one uint8 E8M0 exponent, bias 127), along the last (input) dim; 2 values per byte.
MXFP4_BLOCK = 32
E8M0_BIAS = 127
# Midpoints between consecutive positive e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROWS_PER_CHUNK = 1 << 20  # groups of 32 at once: a float32 temporary holds 2**20 * 32 values at most


def quantize_mxfp4(weight: torch.Tensor, scale: str = "round_up") -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] float (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    The OCP MX FP4 (e2m1) layout that transformers' gpt-oss loader reads.

    Each group of 32 consecutive values along the last dim shares the scale 2**e, e = scales - 127. With
    scale="round_up", e is the smallest exponent such that max|w| <= 6 * 2**e (ROUND_UP, the default of
    triton_kernels' downcast_to_mxfp_torch, which transformers' Mxfp4Quantize calls), so nothing is clipped.
    scale="min_error" takes, per group, whichever of that e and e - 1 gives the smaller squared error, values beyond
    6 * 2**(e-1) clipped to it: for weights already on an MXFP4 grid plus small changes (a merged LoRA), a group whose
    largest value grew a little past 6 * 2**e keeps its scale instead of doubling it and losing a bit of precision in
    all 32 values; on-grid weights encode exactly either way. w / 2**e is rounded to the nearest e2m1 value (ties to
    even code); byte j of a group holds value 2j in its low nibble and value 2j+1 in its high nibble.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = getattr(weight, "dtype", type(weight))
        raise TypeError(f"weight must be a floating point tensor, got {got}")
    if weight.ndim == 0 or weight.shape[-1] % MXFP4_BLOCK != 0:
        raise ValueError(f"weight's last dim must be a multiple of {MXFP4_BLOCK}, got shape {tuple(weight.shape)}")
    if scale not in ("round_up", "min_error"):
        raise ValueError(f"scale must be 'round_up' or 'min_error', got {scale!r}")
    *prefix, k = weight.shape
    groups = k // MXFP4_BLOCK
    flat = weight.detach().reshape(-1, MXFP4_BLOCK)
    blocks = torch.empty(flat.shape[0], MXFP4_BLOCK // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8, device=weight.device)
    midpoints = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=weight.device)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=weight.device)
    for r0 in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, flat.shape[0])
        x = flat[r0:r1].to(torch.float32)  # exact for bf16/fp16/fp32 input
        if not torch.isfinite(x).all():
            raise ValueError("weight contains inf or nan; MXFP4 cannot encode it")
        amax = x.abs().amax(dim=-1)
        # amax = m * 2**p with m in [0.5, 1): the smallest e with amax <= 6 * 2**e is p-3 if m <= 0.75 else p-2.
        mantissa, power = torch.frexp(amax)
        exp = power - 3 + (mantissa > 0.75).to(power.dtype)
        exp = torch.where(amax == 0, torch.full_like(exp, -E8M0_BIAS), exp).clamp(-E8M0_BIAS, E8M0_BIAS)
        q = torch.ldexp(x, (-exp).unsqueeze(-1))  # exact: multiplication by a power of two, |q| <= 6
        code = _e2m1_codes(q, midpoints)
        if scale == "min_error":
            # At e - 1 the values are 2q (those beyond 6 clip to code 6); its squared error in units of 2**e is 1/4
            # of that in units of 2**(e-1). A tie (the same values on both grids) takes the finer grid: for a merged
            # model, the base's scale.
            code_down = _e2m1_codes(2 * q, midpoints)
            err = (values[code] - q).square().sum(-1)
            err_down = (values[code_down] - 2 * q).square().sum(-1) / 4
            down = (err_down <= err) & (exp > -E8M0_BIAS)
            code = torch.where(down.unsqueeze(-1), code_down, code)
            exp = exp - down.to(exp.dtype)
        code = code.to(torch.uint8)
        blocks[r0:r1] = code[:, 0::2] | (code[:, 1::2] << 4)
        scales[r0:r1] = (exp + E8M0_BIAS).to(torch.uint8)
    return blocks.reshape(*prefix, groups, MXFP4_BLOCK // 2), scales.reshape(*prefix, groups)


def _e2m1_codes(q: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (int64, bit 3 the sign) of each scaled value q; |q| beyond 6 gets +-6."""
    mag = q.abs()
    # bucketize (right=False) gives code i with midpoints[i-1] < |q| <= midpoints[i]: a tie goes to the lower
    # code; move it up where the lower code is odd, so ties land on the even code (round half to even).
    code = torch.bucketize(mag, midpoints)
    tie = (code % 2 == 1) & (mag == midpoints[code.clamp(max=len(_FP4_MIDPOINTS) - 1)])
    code = code + tie.to(code.dtype)
    return code | (((q < 0) & (code > 0)).to(code.dtype) << 3)  # a value rounding to 0 is stored as +0


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def decode_table(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A decode table, made once per dtype and device: "fp4" (FP4_VALUES) or "e8m0" (2**(s - 127) for every scale
    byte s, as ldexp scales: torch.pow(2.0, e)). Copied to a GPU at every call, a table would stop the host until
    the GPU caught up (a blocking copy), at each decode of the packed experts in training."""
    key = (name, dtype, device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(FP4_VALUES, dtype=dtype, device=device) if name == "fp4" else \
            torch.pow(2.0, torch.arange(256, dtype=torch.int32, device=device) - E8M0_BIAS).to(dtype)
    return _TABLES[key]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse, pure torch: [..., K/32, 16] + [..., K/32] -> [..., K].

    Reads MXFP4 checkpoints back (mxfp4_checkpoint) and checks transformers' own loader against it.

    Same arithmetic as transformers' convert_moe_packed_tensors (table lookup in `dtype`, then ldexp), but without
    its final transpose: this returns the on-disk orientation [..., out, in].
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"blocks must be [..., G, {MXFP4_BLOCK // 2}] and scales [..., G]; got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    *prefix, groups, nbytes = blocks.shape
    lut = decode_table("fp4", dtype, blocks.device)
    flat = blocks.reshape(-1, nbytes)
    exp = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    out = torch.empty(flat.shape[0], 2 * nbytes, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        r1 = min(r0 + _ROWS_PER_CHUNK, flat.shape[0])
        blk, sub = flat[r0:r1], out[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
        sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(sub, exp[r0:r1], out=sub)
    return out.reshape(*prefix, groups * 2 * nbytes)
