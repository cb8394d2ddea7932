"""gpt-oss's sinks folded around torch's FlashAttention (lora_pipeline.model.varlen_attention) on a GPU, against the
reference pair in float32: the kernels' output, log-sum-exp and gradients, then sink_varlen_attention on the GPU
against the same on the CPU (the reference pair), for a full and a 128-key window (docs/bench/varlen_sinks_*.txt).

    python benchmarks/check_varlen_sinks.py
Four packed sequences (2,048 tokens), 8 query and 2 key-value heads of 64 (gpt-oss-20b's head size and grouping),
bf16 inputs. Each line gives the relative difference (norm of the difference over the reference's norm)."""
import itertools

import torch

from lora_pipeline.model import varlen_attention as va


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    print(torch.__version__)
    torch.manual_seed(0)
    lengths = [700, 300, 981, 67]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    tokens, heads, kv_heads, dim, longest = sum(lengths), 8, 2, 64, max(lengths)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    for window_left in (-1, 127):
        out, lse = va.flash_forward(q, k, v, cu, longest, 0.125, window_left)
        ref_out, ref_lse = va.reference_flash_forward(q, k, v, cu, 0.125, window_left)
        print("window", window_left, "out", tuple(out.shape), "lse", tuple(lse.shape), lse.dtype,
              "ref lse", tuple(ref_lse.shape))
        print("  out rel", rel(out, ref_out))
        print("  lse max abs", (lse - ref_lse).abs().max().item(), "lse[:,:3]", lse[0, :3].tolist(),
              ref_lse[0, :3].tolist())
        grads = va.flash_backward(grad, q, k, v, out, lse, cu, longest, 0.125, window_left)
        ref_grads = va.reference_flash_backward(grad, q, k, v, ref_out, ref_lse, cu, 0.125, window_left)
        print("  grads rel", [round(rel(a, b), 5) for a, b in zip(grads, ref_grads)])
        sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16)
        results = []
        for device in ("cuda", "cpu"):
            leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v, sinks)]
            out = va.sink_varlen_attention(*leaves, cu.to(device), longest, 0.125, window_left + 1)
            results.append([out, *torch.autograd.grad(out, leaves, grad.to(device))])
        print("  sink attention cuda vs cpu reference rel (out, dq, dk, dv, dsinks)",
              [round(rel(a.cpu(), b), 5) for a, b in zip(*results)])


if __name__ == "__main__":
    main()
