"""Flex attention forward and backward at gpt-oss-20b's training shapes, one GPU: the default kernel options against
others and max-autotune, on a full causal and a 128-token window mask (blocks of 128, and of 64 for the window),
beside torch's flash SDPA on the same rows.

    python benchmarks/flex_attention_options.py [seconds]

8 rows of 2,048 tokens packed into one of 16,384, 64 query heads, 8 KV heads, head dim 64, bf16, the log-sum-exp
returned as gpt-oss's sinks need it. One JSON line per variant and mask (docs/bench/flex_attention_options_h100.jsonl).
"""
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
from timing import seconds_per_call  # noqa: E402  (this folder's)

TOKENS, QUERY_HEADS, KV_HEADS, HEAD_DIM, ROW = 16384, 64, 8, 64, 2048
BACKWARD_BLOCKS = [(64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 4, 3), (64, 128, 128, 64, 4, 2),
                   (32, 64, 64, 32, 4, 4), (128, 128, 128, 128, 8, 2)]  # BLOCK_M1, N1, M2, N2, num_warps, num_stages


def main(seconds: float) -> None:
    deadline = time.time() + seconds
    row_of = torch.arange(TOKENS, device="cuda") // ROW

    def causal(b, h, q, k):
        return (row_of[q] == row_of[k]) & (q >= k)

    def window(b, h, q, k):
        return (row_of[q] == row_of[k]) & (q >= k) & (q - k < 128)

    masks = {"causal": create_block_mask(causal, 1, None, TOKENS, TOKENS, device="cuda"),
             "window 128": create_block_mask(window, 1, None, TOKENS, TOKENS, device="cuda"),
             # a 128-token window over blocks of 64 visits 192 keys a query block instead of 256
             "window 128, blocks of 64": create_block_mask(window, 1, None, TOKENS, TOKENS, device="cuda",
                                                           BLOCK_SIZE=64)}

    def tensor(heads, grad=True):
        return torch.randn(1, heads, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

    q, k, v, grad_out = tensor(QUERY_HEADS), tensor(KV_HEADS), tensor(KV_HEADS), tensor(QUERY_HEADS, grad=False)

    def as_rows(x):  # (1, heads, 8 x 2048, dim) -> (8, heads, 2048, dim)
        return x.detach().view(1, x.shape[1], -1, ROW, HEAD_DIM).transpose(1, 2)[0].contiguous()

    rows = [as_rows(x).requires_grad_() for x in (q, k, v)]
    grad_rows = as_rows(grad_out)

    def sdpa_once():
        out = torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
        out.backward(grad_rows)

    print(json.dumps({"variant": "sdpa flash reference (8 x 2048 as a batch, causal, no sinks)", "mask": "causal",
                      "fwd_bwd_ms": round(1000 * seconds_per_call(sdpa_once, q.device, 10), 3)}), flush=True)

    def compiled(options, mode=None):
        def attend(q, k, v, mask):
            out, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options,
                                      return_aux=AuxRequest(lse=True))
            return out, aux.lse
        return torch.compile(attend, mode=mode, fullgraph=True)

    variants = [("default", compiled(None))]
    for m1, n1, m2, n2, warps, stages in BACKWARD_BLOCKS:
        options = {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2, "num_warps": warps,
                   "num_stages": stages}
        variants.append((" ".join(f"{key}={value}" for key, value in options.items()), compiled(options)))
    variants.append(("max-autotune-no-cudagraphs", compiled(None, "max-autotune-no-cudagraphs")))
    for name, attend in variants:
        for mask_name, mask in masks.items():
            if time.time() > deadline:
                return

            def once():
                out, lse = attend(q, k, v, mask)
                torch.autograd.backward([out, lse], [grad_out, torch.ones_like(lse)])
            try:
                row = {"fwd_bwd_ms": round(1000 * seconds_per_call(once, q.device, 10), 3)}
            except Exception as error:  # options this kernel does not take
                row = {"error": " | ".join(str(error).splitlines()[:3])[:300]}
            print(json.dumps({"variant": name, "mask": mask_name, **row}), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1e9)
