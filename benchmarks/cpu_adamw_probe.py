"""Hashes of AdamW (foreach, loop, fused) and of its element-wise pieces on fixed inputs, one thread: run on two CPUs
under the same pins (ATEN_CPU_CAPABILITY, MKL_CBWR, ONEDNN_MAX_CPU_ISA) and compare (docs/reproducibility.md)."""
import hashlib
import json
import os

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().float().numpy().tobytes()).hexdigest()[:12]


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    p0, g0, m0 = (torch.randn(896, 896, generator=g) for _ in range(3))
    v0 = torch.randn(896, 896, generator=g).abs()
    out = {}
    for name, kw in (("foreach", dict(foreach=True)), ("loop", dict(foreach=False)), ("fused", dict(fused=True))):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g0.clone()
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
        for _ in range(3):
            opt.step()
        out["adamw_" + name] = digest(p)
    out |= {
        "sqrt": digest(v0.sqrt()), "div": digest(p0 / (v0 + 1e-8)),
        "addcdiv": digest(torch.addcdiv(p0, m0, v0.sqrt() + 1e-8, value=-1e-3)), "lerp": digest(m0.lerp(g0, 0.1)),
        "mul_scalar": digest(p0 * 0.99), "addcmul": digest(torch.addcmul(v0 * 0.999, g0, g0, value=0.001)),
        "add_alpha": digest(torch.add(p0, g0, alpha=-1e-3)), "pow": digest(v0.pow(0.5)), "exp": digest(g0.exp()),
        "log": digest(v0.log()), "tanh": digest(g0.tanh()),
        "foreach_sqrt": digest(torch._foreach_sqrt([v0])[0]),
        "foreach_lerp": digest(torch._foreach_lerp([m0.clone()], [g0], 0.1)[0]),
        "foreach_addcdiv": digest(torch._foreach_addcdiv([p0.clone()], [m0], [v0.sqrt() + 1e-8], -1e-3)[0]),
        "foreach_addcmul": digest(torch._foreach_addcmul([v0.clone()], [g0], [g0], 0.001)[0]),
        "foreach_mul": digest(torch._foreach_mul([p0.clone()], 0.99)[0]),
        "foreach_div_scalar": digest(torch._foreach_div([v0.clone()], 0.97)[0]),
    }
    print(json.dumps({"torch": torch.__version__, "cbwr": os.environ.get("MKL_CBWR"), "hashes": out}))


if __name__ == "__main__":
    main()
