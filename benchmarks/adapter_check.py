"""Check an adapter saved by a sharded run (FSDP2, DeepSpeed ZeRO-3): whole, trained, and mergeable.

Loads the base with the train stage's loader (lora_pipeline.model.loading.load_model), then the adapter with peft, which
refuses any tensor whose shape differs from the model's (a shard, or ZeRO-3's empty placeholder). Reports the
share of LoRA B matrices that training moved off zero, the largest relative difference to a reference adapter of the
same LoRA (for example the same steps under plain DDP), and the merged model's logits against the adapted model's
on random token ids, as the merge stage checks them; for a mixture-of-experts model, also the share of (layer,
token) routing decisions that merging changed.

    python benchmarks/adapter_check.py --recipe gpt-oss-20b --base /tmp/bench-gpt-oss-20b --adapter /tmp/zero3 \
        --reference /tmp/ddp --label zero3
Prints one JSON line.
"""
import argparse
import os
from pathlib import Path

if "LOCAL_RANK" not in os.environ:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import torch
from peft import PeftModel
from safetensors.torch import load_file

from cli.recipes import apply_sets, compose
from lora_pipeline.config.params import for_stage, validate
from lora_pipeline.model.loading import device, load_model
from bench_rows import emit


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--base", required=True, help="the base model folder the adapter was trained on")
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--reference", help="another adapter of the same LoRA to compare with")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args()

    raw = apply_sets(compose(args.recipe), args.set)
    params = for_stage(validate(raw, source=f"recipes/{args.recipe}.yaml"), "benchmark", ["model", "quantization"])
    tensors = load_file(str(Path(args.adapter) / "adapter_model.safetensors"))
    b_matrices = [t for name, t in tensors.items() if "lora_B" in name]
    row = {"label": args.label, "adapter": args.adapter, "tensors": len(tensors),
           "lora_parameters": sum(t.numel() for t in tensors.values()),
           "empty_tensors": sum(t.numel() == 0 for t in tensors.values()),
           "lora_b_trained": sum(bool(t.abs().max() > 0) for t in b_matrices) / max(len(b_matrices), 1)}
    if args.reference:
        reference = load_file(str(Path(args.reference) / "adapter_model.safetensors"))
        row["same_names_as_reference"] = sorted(reference) == sorted(tensors)
        row["max_relative_diff_to_reference"] = max(
            ((tensors[k].float() - reference[k].float()).norm() / reference[k].float().norm().clamp(min=1e-12)).item()
            for k in tensors if k in reference)

    base = load_model(args.base, params.model, params.quantization, device_map={"": device()})
    model = PeftModel.from_pretrained(base, args.adapter).eval()  # raises on any shape that is not the model's
    ids = torch.randint(3, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0)).to(device())
    moe = getattr(model.config, "num_experts_per_tok", None)
    extra = {"output_router_logits": True} if moe else {}
    row["weight_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    with torch.no_grad():
        adapted = model(input_ids=ids, **extra)
        again = model(input_ids=ids, **extra)  # the same model run twice: the floor any comparison stands on
        merged = model.merge_and_unload()(input_ids=ids, **extra)

    def relative(a, b):
        return ((a.logits.float() - b.logits.float()).abs().max() / a.logits.float().abs().max()).item()

    def chosen(out):  # each token's experts, per layer
        return torch.stack([r.topk(moe, dim=-1).indices.sort(-1).values for r in out.router_logits])

    row["merge_relative_logit_diff"] = relative(adapted, merged)
    row["rerun_relative_logit_diff"] = relative(adapted, again)
    if moe:  # a rounding-sized change can flip a near-tie between experts, and with it the token's whole path
        row["expert_choices_changed"] = (chosen(adapted) != chosen(merged)).any(-1).float().mean().item()
        row["rerun_expert_choices_changed"] = (chosen(adapted) != chosen(again)).any(-1).float().mean().item()
    emit(row, args.out)


if __name__ == "__main__":
    main()
