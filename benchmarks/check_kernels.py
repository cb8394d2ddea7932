"""GPU check of every kernel swap the speed levers make, against the stock path, on small models of the real
architectures (random init, fresh random inputs each run).

    python benchmarks/check_kernels.py --out kernel_checks.json [--only generation ...]
Checks, each as max |logit diff| and |loss diff| against a float32 eager reference and against the bf16 stock path:
  - gpt-oss attention: flex_attention (sinks renormalised by the log-sum-exp) vs eager;
  - gpt-oss experts: grouped_mm vs the eager per-expert loop;
  - Liger (RMSNorm, RoPE, fused linear cross-entropy) vs stock, loss and LoRA gradients;
  - padding-free (rows concatenated, position_ids) vs padded rows: the same per-token loss;
  - generation: the implementations evaluate decodes with (lora_pipeline.generation.use_for_generation, from a model
    loaded as the recipes train it), greedy with a KV cache after left-padded prompts; each step's logits against
    a float32 forward over the same tokens with eager attention and the eager experts loop.
bf16 tolerance: a swap passes when its error against the float32 reference is at most 2x the stock bf16 path's
own error plus 1e-2 (bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding).
"""
import argparse
import copy
import json

import torch


def small_gpt_oss(attn="eager", experts="eager"):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=4096,
                       hidden_size=512, intermediate_size=512, head_dim=64, num_attention_heads=8,
                       num_key_value_heads=2, sliding_window=128, use_cache=False,
                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks away from zero, so the check exercises them
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)
    return model


def small_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=8192, hidden_size=448, intermediate_size=1216, num_hidden_layers=2,
                      num_attention_heads=7, num_key_value_heads=1, use_cache=False, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def set_impl(model, attn=None, experts=None):
    from lora_pipeline.modeling import set_experts_implementation

    if attn:
        model.set_attn_implementation(attn)
    if experts:
        set_experts_implementation(model, experts)
    return model


def forward(model, ids, dtype, **kw):
    model = model.to("cuda", dtype)
    out = model(input_ids=ids, labels=ids, **kw)
    return out.logits.float() if out.logits is not None else None, out.loss.float()


def compare(name, reference, stock, candidate):
    (ref_logits, ref_loss), (st_logits, st_loss), (c_logits, c_loss) = reference, stock, candidate
    stock_err = (st_logits - ref_logits).abs().max().item()
    cand_err = (c_logits - ref_logits).abs().max().item()
    rel = lambda x: ((x - ref_logits).norm() / ref_logits.norm()).item()  # noqa: E731
    row = {"check": name, "stock_bf16_vs_fp32_rel_logit": rel(st_logits), "swap_bf16_vs_fp32_rel_logit": rel(c_logits),
           "stock_bf16_vs_fp32_max_abs_logit": stock_err, "swap_bf16_vs_fp32_max_abs_logit": cand_err,
           "swap_vs_stock_max_abs_logit": (c_logits - st_logits).abs().max().item(),
           "loss_fp32": ref_loss.item(), "loss_stock_bf16": st_loss.item(), "loss_swap_bf16": c_loss.item(),
           "tolerance": 2 * stock_err + 1e-2}
    row["pass"] = bool(cand_err <= row["tolerance"] and abs(c_loss.item() - ref_loss.item()) <= 2e-2 * ref_loss.item())
    return row


@torch.no_grad()
def check_gpt_oss(rows):
    ids = torch.randint(3, 4096, (2, 512), device="cuda")
    base = small_gpt_oss()
    reference = forward(set_impl(copy.deepcopy(base), "eager", "eager"), ids, torch.float32)
    stock = forward(set_impl(copy.deepcopy(base), "eager", "eager"), ids, torch.bfloat16)
    rows.append(compare("gpt-oss attention: flex_attention vs eager", reference, stock,
                        forward(set_impl(copy.deepcopy(base), "flex_attention", "eager"), ids, torch.bfloat16)))
    rows.append(compare("gpt-oss experts: grouped_mm vs eager", reference, stock,
                        forward(set_impl(copy.deepcopy(base), "eager", "grouped_mm"), ids, torch.bfloat16)))
    rows.append(compare("gpt-oss: flex_attention + grouped_mm vs eager", reference, stock,
                        forward(set_impl(copy.deepcopy(base), "flex_attention", "grouped_mm"), ids, torch.bfloat16)))


def lora_grads(model, ids, **kw):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                                  init_lora_weights=False))
    loss = peft_model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for n, p in peft_model.named_parameters() if p.requires_grad])
    return loss.detach().float(), grads


def check_liger(rows):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    for name, build in (("qwen2", small_qwen2), ("gpt-oss", small_gpt_oss)):
        ids = torch.randint(3, 4096, (4, 512), device="cuda")
        stock_model = build().to("cuda", torch.bfloat16)
        liger_model = copy.deepcopy(stock_model)
        _apply_liger_kernel_to_instance(model=liger_model)
        stock_loss, stock_grads = lora_grads(stock_model, ids)
        liger_loss, liger_grads = lora_grads(liger_model, ids)
        rel = ((liger_grads - stock_grads).norm() / stock_grads.norm()).item()
        rows.append({"check": f"{name}: Liger vs stock (bf16, LoRA)", "loss_stock": stock_loss.item(),
                     "loss_liger": liger_loss.item(), "abs_loss_diff": abs(liger_loss - stock_loss).item(),
                     "lora_grad_rel_diff": rel, "tolerance": "loss within 1e-2 relative, grads within 5e-2 relative",
                     "pass": bool(abs(liger_loss - stock_loss).item() <= 1e-2 * stock_loss.item() and rel <= 5e-2)})


@torch.no_grad()
def check_padding_free(rows):
    """Three rows of different lengths: padded with an attention mask, vs concatenated with position_ids."""
    for attn in ("sdpa", "flex_attention"):
        model = set_impl(small_qwen2(), attn).to("cuda", torch.float32)
        lengths = [300, 170, 41]
        seqs = [torch.randint(3, 8192, (n,), device="cuda") for n in lengths]
        padded = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device="cuda")
        mask = torch.zeros_like(padded)
        for i, s in enumerate(seqs):
            padded[i, : len(s)], mask[i, : len(s)] = s, 1
        labels = padded.masked_fill(mask == 0, -100)
        padded_loss = model(input_ids=padded, attention_mask=mask, labels=labels).loss
        flat = torch.cat(seqs)[None]
        position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        flat_labels = flat.clone()
        flat_labels[position_ids == 0] = -100  # no token predicts the start of the next row
        flat_loss = model(input_ids=flat, position_ids=position_ids, labels=flat_labels).loss
        rows.append({"check": f"padding-free vs padded rows ({attn}, fp32)", "loss_padded": padded_loss.item(),
                     "loss_padding_free": flat_loss.item(), "abs_loss_diff": abs(flat_loss - padded_loss).item(),
                     "tolerance": 1e-4, "pass": bool(abs(flat_loss - padded_loss).item() <= 1e-4)})


def generated_logits(model, ids, mask, new_tokens):
    """Greedy generation after left-padded prompts: the sequences and each step's logits [batch, steps, vocab]."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1).float()


def forward_logits(reference, sequences, mask, new_tokens):
    """A float32 forward over whole sequences (prompt + generated), at the positions that predicted each new token."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, mask.shape[1]:])], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
    logits = reference(input_ids=sequences, attention_mask=full_mask, position_ids=positions).logits.float()
    return logits[:, mask.shape[1] - 1:-1]


@torch.no_grad()
def check_generation(rows):
    from lora_pipeline.generation import use_for_generation

    new_tokens = 32
    for name, build, vocab in (("gpt-oss", small_gpt_oss, 4096), ("qwen2", small_qwen2, 8192)):
        lengths = [37, 64, 90, 120]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):  # left padding, as evaluate pads
            ids[i, -n:], mask[i, -n:] = torch.randint(3, vocab, (n,), device="cuda"), 1
        base = build()
        base.config.use_cache = True
        loop, grouped = ("eager", "grouped_mm") if name == "gpt-oss" else (None, None)
        reference = set_impl(copy.deepcopy(base), "eager", loop).to("cuda")
        stock = set_impl(copy.deepcopy(base), "eager", loop).to("cuda", torch.bfloat16)
        candidate = set_impl(copy.deepcopy(base), "flex_attention", grouped)
        candidate = candidate.to("cuda", torch.bfloat16)
        chosen = use_for_generation(candidate)
        stock_seq, stock_logits = generated_logits(stock, ids, mask, new_tokens)
        cand_seq, cand_logits = generated_logits(candidate, ids, mask, new_tokens)
        stock_err = (stock_logits - forward_logits(reference, stock_seq, mask, new_tokens)).abs().max().item()
        cand_ref = forward_logits(reference, cand_seq, mask, new_tokens)
        cand_err = (cand_logits - cand_ref).abs().max().item()
        row = {"check": f"{name} generation: {chosen['attention']} attention, {chosen['experts']} experts, KV cache "
                        f"vs a float32 eager forward", "implementations": chosen,
               "stock_bf16_eager_generate_max_abs_logit": stock_err, "swap_bf16_generate_max_abs_logit": cand_err,
               "swap_rel_logit": ((cand_logits - cand_ref).norm() / cand_ref.norm()).item(),
               "tokens_same_as_stock": (cand_seq == stock_seq).float().mean().item(),
               "tolerance": 2 * stock_err + 1e-2}
        row["pass"] = bool(cand_err <= row["tolerance"])
        rows.append(row)


CHECKS = {"generation": check_generation, "gpt-oss": check_gpt_oss, "liger": check_liger,
          "padding-free": check_padding_free}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run these checks alone")
    args = parser.parse_args()
    rows = []
    for name in args.only or CHECKS:
        check = CHECKS[name]
        try:
            check(rows)
        except Exception as exc:  # one failing check must not hide the others
            rows.append({"check": check.__name__, "pass": False, "error": f"{type(exc).__name__}: {exc}"})
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"{sum(r['pass'] for r in rows)} of {len(rows)} checks pass")


if __name__ == "__main__":
    main()
