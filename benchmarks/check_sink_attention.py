"""GPU check: lora_pipeline.families.gpt_oss.sink_attention, gpt-oss's decoding attention, against transformers'
eager one.

    python benchmarks/check_sink_attention.py [--batch 301] [--out rows.jsonl]
Both in bfloat16 at gpt-oss-20b's shapes on left-padded rows, against the same arithmetic in float64: the grouped
attention passes where its error is no larger than eager's own (mean and max, within 25 %). A decode step runs fused
and unfused (eager's arithmetic: bitwise_equal); the last row forces a prefill in chunks of queries. Each is timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_pipeline.families.gpt_oss import sink_attention  # noqa: E402
from lora_pipeline.families.gpt_oss.sink_attention import grouped_sink_attention  # noqa: E402
from bench_rows import emit  # noqa: E402  (this folder's)
from timing import seconds_per_call  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64
TOLERANCE = 1.25  # the grouped attention's error may exceed eager's by at most this factor


def inputs(batch, q_len, k_len, device, seed=0):
    """Query, key, value, sinks and an additive mask: causal over the last q_len positions, each row left-padded."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, k_len, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, k_len, HEAD_DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen)
    pad = torch.randint(0, k_len // 2, (batch,), generator=gen)
    key_pos = torch.arange(k_len)
    query_pos = torch.arange(k_len - q_len, k_len)
    allowed = (key_pos[None, None, :] <= query_pos[None, :, None]) & (key_pos[None, None, :] >= pad[:, None, None])
    mask = torch.zeros(batch, 1, q_len, k_len).masked_fill(~allowed[:, None], float("-inf"))
    return [t.to(device) for t in (q, k, v, sinks, mask)]


def attend(how, q, k, v, sinks, mask, dtype):
    module = SimpleNamespace(sinks=sinks.to(dtype), num_key_value_groups=HEADS // KV_HEADS, training=False)
    args = (module, q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), HEAD_DIM ** -0.5)
    with sink_attention.fused_decode(how == "grouped"):
        out, _ = (eager_attention_forward if how == "eager" else grouped_sink_attention)(*args)
    return out


def check(batch, q_len, k_len, device, queries_at_once=None):
    """One shape's row; queries_at_once: the grouped attention in chunks of that many queries."""
    tensors = inputs(batch, q_len, k_len, device)
    reference = attend("eager", *tensors, torch.float64)
    scale = reference.abs().mean().item()
    row = {"batch": batch, "q_len": q_len, "k_len": k_len, "device": torch.cuda.get_device_name()
           if device.type == "cuda" else "cpu"}
    scores_at_once = sink_attention.SCORES_AT_ONCE
    if queries_at_once:
        row["queries_at_once"] = queries_at_once
        sink_attention.SCORES_AT_ONCE = batch * HEADS * k_len * queries_at_once
    got = {}
    try:
        for how in ("eager", "grouped", "grouped, unfused")[:3 if q_len == 1 else 2]:
            got[how] = attend(how, *tensors, torch.bfloat16)
            error = (got[how].double() - reference).abs()
            row[how] = {"mean_rel_error": round(error.mean().item() / scale, 6),
                        "max_rel_error": round(error.max().item() / scale, 5),
                        "ms": round(1000 * seconds_per_call(lambda h=how: attend(h, *tensors, torch.bfloat16), device),
                                    3)}
    finally:
        sink_attention.SCORES_AT_ONCE = scores_at_once
    row["bitwise_equal"] = bool(torch.equal(got["eager"], got.get("grouped, unfused", got["grouped"])))
    row["passed"] = all(row[how][key] <= TOLERANCE * row["eager"][key] + 1e-6 for how in got if how != "eager"
                        for key in ("mean_rel_error", "max_rel_error"))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=301)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # decode steps at three cache lengths (the window layers' 128 among them), then a 128-token prefill, whole and in
    # chunks of 48 queries
    shapes = [(1, 128, None), (1, 384, None), (1, 640, None), (1, 851, None), (128, 128, None), (128, 128, 48)]
    rows = [check(args.batch, q_len, k_len, device, chunk) for q_len, k_len, chunk in shapes]
    for row in rows:
        emit(row, args.out)
    if not all(row["passed"] for row in rows):
        sys.exit(f"grouped_sink_attention's error exceeds eager's by more than {TOLERANCE}x")


if __name__ == "__main__":
    main()
