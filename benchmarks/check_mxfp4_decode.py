"""GPU check: the packed experts' decoders (lora_pipeline.families.gpt_oss.mxfp4_experts DECODERS) at
gpt-oss-20b's expert shapes, against mxfp4.dequantize_mxfp4 bit for bit, each timed beside a plain copy of the
decoded weight's bytes (the memory's pace). One JSON line per decoder and weight; exits non-zero if a decoder differs.
    python benchmarks/check_mxfp4_decode.py [--experts 32] [--hidden 2880] [--decoders ...] [--out rows.jsonl]
On a CPU (--device cpu, smaller --hidden) the decoders that run there are compared the same way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4  # noqa: E402
from lora_pipeline.families.gpt_oss.mxfp4_experts import DECODERS, decode_weight  # noqa: E402
from bench_rows import emit  # noqa: E402  (this folder's)
from timing import seconds_per_call  # noqa: E402  (this folder's)

HIDDEN = 2880  # gpt-oss-20b's hidden and intermediate size


def weights(hidden: int) -> dict[str, tuple[int, int]]:
    """gpt-oss's two expert weights, [out, in]."""
    return {"gate_up_proj": (2 * hidden, hidden), "down_proj": (hidden, hidden)}


def packed(experts, out, k, device, seed=0):
    """Random blocks, and scales of exponents 2**-27 .. 2**22 (gpt-oss-20b's lie well inside; near 2**-127 and 2**127
    the 16-bit table lookup of dequantize_mxfp4 rounds differently from a product in float32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, k // MXFP4_BLOCK, MXFP4_BLOCK // 2), dtype=torch.uint8,
                           generator=gen)
    scales = torch.randint(100, 150, (experts, out, k // MXFP4_BLOCK), dtype=torch.uint8, generator=gen)
    return blocks.to(device), scales.to(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="a multiple of 32")
    parser.add_argument("--decoders", nargs="+", choices=DECODERS, default=list(DECODERS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for name, (out, k) in weights(args.hidden).items():
        blocks, scales = packed(args.experts, out, k, device)
        expected = dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(-2, -1)
        decoded_bytes = expected.numel() * expected.element_size()
        source = torch.empty_like(expected)
        copy_s = seconds_per_call(lambda: source.clone(), device)  # reads and writes the decoded weight's bytes
        moved = blocks.numel() + scales.numel() + decoded_bytes  # what a decoder must read and write at least
        for decoder in args.decoders:
            got = decode_weight(blocks, scales, torch.bfloat16, decoder)
            same = bool(torch.equal(got.view(torch.int16), expected.view(torch.int16))) and got.shape == expected.shape
            seconds = seconds_per_call(lambda: decode_weight(blocks, scales, torch.bfloat16, decoder), device)
            row = {"check": "mxfp4_decode", "weight": name, "shape": list(blocks.shape), "decoder": decoder,
                   "bitwise_equal": same, "ms": round(seconds * 1e3, 3), "gb_per_s": round(moved / seconds / 1e9),
                   "copy_ms": round(copy_s * 1e3, 3), "copy_gb_per_s": round(2 * decoded_bytes / copy_s / 1e9),
                   "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__}
            emit(row, args.out)
            rows.append(row)
            del got
    if not all(row["bitwise_equal"] for row in rows):
        sys.exit("a decoder's weight differs from dequantize_mxfp4's")


if __name__ == "__main__":
    main()
