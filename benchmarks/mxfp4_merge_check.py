"""A merged gpt-oss saved in MXFP4 (merge.save_format: mxfp4) against the same merge saved in bf16, at full width.

openai/gpt-oss-20b's config at reduced depth, randomly initialised, its experts put on the MXFP4 grid as the
released checkpoint has them; random low-rank deltas (what a LoRA r=8 on attention and experts merges) of a given
size relative to each weight are added, and the merged model is saved in bf16 (save_pretrained, as
merge.save_format: model_dtype with model.dtype bfloat16) and in MXFP4 (as the merge stage writes it). The MXFP4
one is loaded back with Mxfp4Config(dequantize=True), as openai/gpt-oss-20b is. Prints one JSON object:

- sizes on disk, per layer and extrapolated to the real 24 layers;
- per size of delta, and for the merge stage's min_error scales and round_up scales (transformers' and triton's
  rule): logits of the MXFP4 merged model against the bf16 merged model's on random token sequences (max and mean
  |difference|, top-1 agreement), and what re-encoding does to the experts: relative error against the bf16 merged
  experts, the share of the delta kept (<Q(W+D) - W, D> / |D|^2: 1 all, 0 none), the share of values and scales
  that differ from the base's;
- for scale, the deltas' own effect on the logits (bf16 merged against the base), and the experts' deltas' alone
  (bf16 merged against the base with only the attention deltas: what is lost if no expert delta survives).

    python benchmarks/mxfp4_merge_check.py --layers 4 --out mxfp4_merge_check.json   # one H200
    python benchmarks/mxfp4_merge_check.py --layers 1 --experts 4 --relative-delta 0.01 --sequences 2 \
        --length 64 --device cpu                                                  # a quick check on a CPU
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lora_pipeline.merge.merged_checks import compare_logits
from lora_pipeline.model.loading import load_model
from lora_pipeline.families.gpt_oss.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint
from pipeline_setup import gpt_oss_20b_config, random_bf16_model  # benchmarks/, the script's folder

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
REAL_LAYERS = 24
# model.* params for load_model: bf16, and the eager attention and experts from_pretrained picks for gpt-oss
BF16 = SimpleNamespace(dtype="bfloat16", attn_implementation="eager", experts_implementation="eager",
                       trust_remote_code=False)


def on_grid(w: torch.Tensor) -> torch.Tensor:
    """An expert param [E, in, out] as the released checkpoint holds it: MXFP4 (round_up scales), dequantized."""
    return dequantize_mxfp4(*quantize_mxfp4(w.transpose(1, 2)), dtype=w.dtype).transpose(1, 2)


def low_rank_delta(w: torch.Tensor, relative: float, rank: int, g: torch.Generator) -> torch.Tensor:
    """B @ A of rank `rank` (one per expert for a 3-D param), scaled to |delta| = relative * |w| per matrix."""
    *lead, rows, cols = w.shape
    b = torch.randn(*lead, rows, rank, generator=g, device=w.device)
    a = torch.randn(*lead, rank, cols, generator=g, device=w.device)
    delta = b @ a
    norms = delta.flatten(-2).norm(dim=-1)[..., None, None]
    return delta * (relative * w.float().flatten(-2).norm(dim=-1)[..., None, None] / norms)


def expert_stats(base: torch.Tensor, merged: torch.Tensor) -> dict:
    """Sums over one expert param [E, in, out] of what re-encoding `merged` does, per scale rule (see the docstring)."""
    out = {}
    for e in range(base.shape[0]):  # one expert at a time: bounded temporaries
        w = base[e].transpose(0, 1).float()  # on-disk orientation [out, in]
        m = merged[e].transpose(0, 1).float()
        d = m - w
        _, base_scales = quantize_mxfp4(w)
        for rule in ("min_error", "round_up"):
            blocks, scales = quantize_mxfp4(m, scale=rule)
            r = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
            s = out.setdefault(rule, dict.fromkeys(("err2", "merged2", "kept", "delta2", "changed", "values",
                                                    "scales_changed", "scales"), 0.0))
            s["err2"] += float((r - m).square().sum())
            s["merged2"] += float(m.square().sum())
            s["kept"] += float(((r - w) * d).sum())
            s["delta2"] += float(d.square().sum())
            s["changed"] += float((r != w).sum())
            s["values"] += r.numel()
            s["scales_changed"] += float((scales != base_scales).sum())
            s["scales"] += scales.numel()
    return out


def checkpoint_bytes(folder: Path, layers: int) -> dict:
    """Bytes of the safetensors tensors in a folder: total, per decoder layer, and the rest (embeddings, head)."""
    from safetensors import safe_open

    total = per_layers = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape = sl.get_shape()
                nbytes = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I64": 8}[sl.get_dtype()]
                for n in shape:
                    nbytes *= n
                total += nbytes
                per_layers += nbytes if key.startswith("model.layers.") else 0
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    per_layer = per_layers / layers
    rest = total - per_layers
    return {"file_bytes": files, "per_layer_bytes": round(per_layer), "other_bytes": rest,
            f"extrapolated_{REAL_LAYERS}_layers_gb": round((rest + REAL_LAYERS * per_layer) / 1e9, 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the real model has 24)")
    parser.add_argument("--experts", type=int, default=32, help="experts per layer (the real model has 32; fewer "
                        "only for a quick CPU check)")
    parser.add_argument("--relative-delta", type=float, nargs="+", default=[0.003, 0.01, 0.03],
                        help="|delta| / |W| of the merged LoRA, per matrix; the first is also saved in bf16 for the "
                             "sizes")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", help="a new folder for the checkpoints is made in it (default: the temp dir), "
                        "and removed at the end")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()

    start = time.perf_counter()
    timings = {}
    work = Path(tempfile.mkdtemp(prefix="mxfp4-merge-check-", dir=args.workdir))
    device = torch.device(args.device)
    config = gpt_oss_20b_config(args.layers, num_local_experts=args.experts,
                                num_experts_per_tok=min(4, args.experts))
    torch.manual_seed(0)
    model = random_bf16_model(config, device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(EXPERTS):
                p.copy_(on_grid(p))
    timings["build_s"] = time.perf_counter() - start
    ids = torch.randint(0, config.vocab_size, (args.sequences, args.length),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits.float().cpu()

    base_logits = logits(model)
    targets = [n for n, _ in model.named_parameters() if n.endswith(EXPERTS + ATTENTION)]
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n in targets}
    result = {"config": {"layers": args.layers, "experts": args.experts, "hidden_size": config.hidden_size,
                         "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
                         "rank": args.rank, "tokens": args.sequences * args.length, "device": str(device),
                         "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                         "torch": torch.__version__},
              "deltas": []}
    g = torch.Generator(device=device).manual_seed(2)
    for i, relative in enumerate(args.relative_delta):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in base:
                    p.copy_(base[name].float() + low_rank_delta(base[name], relative, args.rank, g))
        merged_logits = logits(model)  # the bf16 merged model: what save_pretrained writes and loads back exactly
        merged_experts = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(EXPERTS)}
        with torch.no_grad():  # the attention deltas alone: what is left if the experts' deltas were all lost
            for name, p in model.named_parameters():
                if name in merged_experts:
                    p.copy_(base[name])
            attention_only_logits = logits(model)
            for name, p in model.named_parameters():
                if name in merged_experts:
                    p.copy_(merged_experts[name])
        del merged_experts

        t = time.perf_counter()
        stats = {}
        for name, p in model.named_parameters():
            if name.endswith(EXPERTS):
                for rule, s in expert_stats(base[name], p.detach()).items():
                    acc = stats.setdefault(rule, dict.fromkeys(s, 0.0))
                    for key, value in s.items():
                        acc[key] += value
        timings["expert_stats_s"] = timings.get("expert_stats_s", 0.0) + time.perf_counter() - t
        entry = {"relative_delta": relative,
                 "logits_delta_effect": compare_logits(merged_logits, base_logits),
                 "logits_expert_delta_effect": compare_logits(merged_logits, attention_only_logits)}
        for rule, s in stats.items():
            entry[rule] = {"experts": {"relative_error": (s["err2"] / s["merged2"]) ** 0.5,
                                       "delta_kept": s["kept"] / s["delta2"],
                                       "values_changed": s["changed"] / s["values"],
                                       "scales_changed": s["scales_changed"] / s["scales"]}}

            folder = work / f"mxfp4-{rule}-{relative:g}"
            t = time.perf_counter()
            save_mxfp4_checkpoint(model, folder, scale=rule, device=device)
            timings.setdefault(f"save_mxfp4_{rule}_s", []).append(round(time.perf_counter() - t, 1))
            if i == 0 and rule == "min_error":
                t = time.perf_counter()
                model.save_pretrained(work / "bf16")
                timings["save_bf16_s"] = round(time.perf_counter() - t, 1)
                result["sizes"] = {"bf16": checkpoint_bytes(work / "bf16", args.layers),
                                   "mxfp4": checkpoint_bytes(folder, args.layers)}
                result["sizes"]["ratio"] = round(result["sizes"]["mxfp4"]["file_bytes"] /
                                                 result["sizes"]["bf16"]["file_bytes"], 3)
                shutil.rmtree(work / "bf16")
            t = time.perf_counter()
            loaded = load_model(folder, BF16, device_map=str(device))  # MXFP4 dequantized, as openai/gpt-oss-20b
            timings.setdefault(f"load_mxfp4_{rule}_s", []).append(round(time.perf_counter() - t, 1))
            entry[rule]["logits_mxfp4_vs_bf16"] = compare_logits(merged_logits, logits(loaded))
            del loaded
            shutil.rmtree(folder)
        result["deltas"].append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
    shutil.rmtree(work)
    timings["total_s"] = time.perf_counter() - start
    result["timings"] = {k: round(v, 1) if isinstance(v, float) else v for k, v in timings.items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
