"""GPU check of the kernel swaps the recipes' speed levers make, against the stock path, on small models of the real
architectures (random init, fresh random inputs each run).

    python benchmarks/check_kernels.py --out kernel_checks.json [--only generation ...]
Each check (CHECKS; its function's docstring says what it compares) reports max |logit diff| and |loss diff|, and
LoRA gradients where training runs it, against a float32 reference and the bf16 stock path. A swap passes when its
error against float32 is at most 2x the stock bf16 path's plus 1e-2 (bf16 keeps 8 bits of mantissa: ~4e-3 relative
per rounding); for gradients the same on the relative norm of the error.
"""
import argparse
import copy
import itertools
import json

import torch


def small_gpt_oss(experts_per_token=2):
    """gpt-oss-20b's architecture, narrow: a sliding-window and a full-attention layer, 8 experts."""
    from transformers import GptOssForCausalLM

    from pipeline_setup import gpt_oss_20b_config  # benchmarks/, the script's folder

    torch.manual_seed(0)
    model = GptOssForCausalLM(gpt_oss_20b_config(2, num_local_experts=8, num_experts_per_tok=experts_per_token,
                                                 vocab_size=4096, hidden_size=512, intermediate_size=512,
                                                 num_attention_heads=8, num_key_value_heads=2))
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
    from lora_pipeline.model.loading import set_experts_implementation

    if attn:
        model.set_attn_implementation(attn)
    if experts:
        set_experts_implementation(model, experts)
    return model


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
    """Liger's kernels (RMSNorm, RoPE, SwiGLU) against the stock model: loss and LoRA gradients in bf16."""
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


def packed_lora(rows, label: str, candidates: dict, model: str = "qwen2") -> None:
    """Qwen2 (or gpt-oss, its sinks and sliding window) with LoRA over padding-free rows with a padded tail, as the
    train stage batches them (TRL's collator: position_ids and the sequence bounds): a float32 reference (flex
    attention; gpt-oss eager) and bf16 flex attention (stock) against each candidate, `name: (attention,
    torch.compile mode of the decoder layers)`, in bf16: logits, loss and the LoRA gradients, for two packed lengths
    (compiled layers then build a graph over a symbolic length)."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from lora_pipeline.families.gpt_oss.packed_masks import mask_packed_rows
    from lora_pipeline.model.varlen_attention import register
    from lora_pipeline.train.training import compile_decoder_layers

    register()
    torch.manual_seed(0)
    # gpt-oss routes every token to all its experts here: with top-2 routing a rounding difference flips tokens to
    # other experts, and those flips, not the attention, decide how far bf16 runs land from float32
    base, vocab, reference = ((small_gpt_oss(experts_per_token=8), 4096, "eager") if model == "gpt-oss" else
                              (small_qwen2(), 8192, "flex_attention"))
    targets = (["q_proj", "k_proj", "v_proj", "o_proj"] if model == "gpt-oss" else
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    models = {}
    for name, dtype, (attention, mode) in (("fp32", torch.float32, (reference, "none")),
                                           ("stock", torch.bfloat16, ("flex_attention", "none")),
                                           *((name, torch.bfloat16, how) for name, how in candidates.items())):
        torch.manual_seed(1)
        model_of_name = set_impl(copy.deepcopy(base), attention).to("cuda", dtype)
        mask_packed_rows(model_of_name)  # gpt-oss's eager and flex attention: the packed rows apart, as train runs them
        models[name] = get_peft_model(model_of_name, LoraConfig(
            r=8, lora_alpha=32, target_modules=targets, lora_dropout=0.0, init_lora_weights=False))
        compile_decoder_layers(models[name], mode)
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=256)
    for lengths in ([700, 300, 981], [512, 1200, 77, 640]):  # packed lengths 2048 and 2496 with their tails
        batch = collate([{"input_ids": torch.randint(3, vocab, (n,)).tolist()} for n in lengths])
        batch = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        results = {}
        for name, peft_model in models.items():
            peft_model.zero_grad()
            out = peft_model(**batch)
            out.loss.backward()
            grads = torch.cat([p.grad.flatten().float() for p in peft_model.parameters() if p.requires_grad])
            results[name] = (out.logits.float().detach(), out.loss.float().detach(), grads)
        rel = lambda g: ((g - results["fp32"][2]).norm() / results["fp32"][2].norm()).item()  # noqa: E731
        for name, (attention, mode) in candidates.items():
            row = compare(f"{model} LoRA: {label} {name} ({attention}, layers compiled: {mode}) vs eager flex "
                          f"(bf16, packed {batch['input_ids'].shape[1]})",
                          results["fp32"][:2], results["stock"][:2], results[name][:2])
            row |= {"stock_lora_grad_rel": rel(results["stock"][2]), "swap_lora_grad_rel": rel(results[name][2])}
            row["pass"] = bool(row["pass"] and row["swap_lora_grad_rel"] <= 2 * row["stock_lora_grad_rel"] + 1e-2)
            rows.append(row)


def check_varlen_attention(rows):
    """Qwen2 under torch_varlen (torch's FlashAttention for variable-length sequences), layers eager and compiled by
    Inductor (train.compile_layers), against eager flex attention."""
    packed_lora(rows, "torch's varlen FlashAttention", {"varlen": ("torch_varlen", "none"),
                                                        "varlen-compiled": ("torch_varlen", "default")})


def check_varlen_kernels(rows):
    """torch's FlashAttention forward and backward (varlen_attention.flash_*) against the float32 reference pair, and
    sink_varlen_attention (gpt-oss's sinks folded around them) on the GPU against the same on the CPU, for a full and
    a 128-key window: 4 packed sequences (2,048 tokens), 8 query and 2 key-value heads of 64, bf16 inputs."""
    from lora_pipeline.model import varlen_attention as va

    torch.manual_seed(0)
    lengths = [700, 300, 981, 67]
    cu, longest = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda"), max(lengths)
    q, grad = (torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    for window_left in (-1, 127):
        out, lse = va.flash_forward(q, k, v, cu, longest, 0.125, window_left)
        ref_out, ref_lse = va.reference_flash_forward(q, k, v, cu, 0.125, window_left)
        grads = va.flash_backward(grad, q, k, v, out, lse, cu, longest, 0.125, window_left)
        ref_grads = va.reference_flash_backward(grad, q, k, v, ref_out, ref_lse, cu, 0.125, window_left)
        folded = []
        for device in ("cuda", "cpu"):
            leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v, sinks)]
            folded_out = va.sink_varlen_attention(*leaves, cu.to(device), longest, 0.125, window_left + 1)
            folded.append([folded_out, *torch.autograd.grad(folded_out, leaves, grad.to(device))])
        diffs = {"out_rel": rel(out, ref_out), **{f"d{x}_rel": rel(a, b) for x, a, b in zip("qkv", grads, ref_grads)},
                 **{f"sinks_folded_{x}_gpu_vs_cpu_rel": rel(a.cpu(), b)
                    for x, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), *folded)}}
        lse_max_abs = (lse - ref_lse).abs().max().item()
        rows.append({"check": f"varlen kernels and sinks folded around them, window {window_left}", **diffs,
                     "lse_max_abs": lse_max_abs, "tolerance": "relative 8e-3 (two bf16 roundings), lse 1e-4",
                     "pass": all(d <= 8e-3 for d in diffs.values()) and lse_max_abs <= 1e-4})


def check_varlen_sinks(rows):
    """The small gpt-oss (a window and a full layer, sinks away from zero) under torch_varlen, its sinks folded around
    the kernel (varlen_kernels checks the kernels alone)."""
    packed_lora(rows, "torch's varlen FlashAttention, sinks folded in", {"varlen": ("torch_varlen", "none")},
                model="gpt-oss")


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
    """What evaluate decodes with (use_for_generation), greedy with a KV cache after left-padded prompts: each step's
    logits against a float32 forward over the same tokens with eager attention and the eager experts loop."""
    from lora_pipeline.evaluate.generation import use_for_generation

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


def mxfp4_values(model) -> None:
    """Every expert weight replaced, in place, by its MXFP4 round trip: the values a dequantized MXFP4 checkpoint
    holds (what grouped_mm_mxfp4 packs losslessly)."""
    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk, expert_to_disk

    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for e in range(weight.shape[0]):
                    weight[e].copy_(expert_from_disk(*expert_to_disk(weight[e]), weight.dtype))


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def lora_pass(model, ids):
    """LoRA (r 8, random A and B, seeded) on the attention projections, input embeddings that need a gradient: the
    logits, loss, the embeddings' and LoRA's gradients of one forward + backward, and the extra peak memory it takes
    over what was allocated before it (activations and transients, GiB)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    lora = [p for p in peft_model.parameters() if p.requires_grad]
    embeds = peft_model.get_input_embeddings()(ids).detach().requires_grad_()

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = peft_model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    torch.cuda.synchronize()
    extra_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    return {"logits": out.logits.detach().float(), "loss": out.loss.detach().float(),
            "embeds_grad": embeds.grad.float().clone(), "extra_peak_gib": extra_gib,
            "lora_grads": torch.cat([p.grad.flatten().float() for p in lora])}


def check_mxfp4_experts(rows, layers=2, tokens=2048):
    """grouped_mm_mxfp4 against the bf16 grouped_mm path, gpt-oss-20b's widths (hidden and intermediate 2880, 32
    experts, top 4) over `layers` layers, the same MXFP4 values in both; reference: the same model in float32 with
    the eager experts loop."""
    from pipeline_setup import gpt_oss_20b_config, random_bf16_model  # benchmarks/, the script's folder

    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk
    from lora_pipeline.families.gpt_oss.mxfp4_experts import (forced_path, grouped_mm_mxfp4_experts_forward,
                                                              pack_experts, paths_run)

    config = gpt_oss_20b_config(layers, vocab_size=4096)
    torch.manual_seed(0)
    base = random_bf16_model(config, "cuda")
    with torch.no_grad():
        for layer in base.model.layers:  # sinks away from zero, as small_gpt_oss has them
            layer.self_attn.sinks.normal_(0, 1)
    mxfp4_values(base)
    ids = torch.randint(3, 4096, (2, tokens // 2), device="cuda")
    values = sum(p.numel() for n, p in base.named_parameters() if n.endswith(("experts.gate_up_proj",
                                                                              "experts.down_proj")))
    reference = lora_pass(set_impl(copy.deepcopy(base).float(), "eager", "eager"), ids)
    stock_model = set_impl(copy.deepcopy(base), "eager", "grouped_mm")
    stock_bytes = model_bytes(stock_model)
    stock = lora_pass(stock_model, ids)
    del stock_model
    packed_model = set_impl(base, "eager", "grouped_mm")
    summary = pack_experts(packed_model)
    packed_bytes = model_bytes(packed_model)
    with forced_path(glue="eager"):  # bit for bit against stock; the compiled glue is checked below
        packed = lora_pass(packed_model, ids)
    ran = paths_run(packed_model)
    row = compare(f"gpt-oss experts: grouped_mm_mxfp4 (packed MXFP4) vs grouped_mm (bf16), {layers} layers of "
                  "gpt-oss-20b's shapes", (reference["logits"], reference["loss"]),
                  (stock["logits"], stock["loss"]), (packed["logits"], packed["loss"]))
    rel = lambda x, ref: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    grads_pass = True
    for key in ("embeds_grad", "lora_grads"):
        stock_err, packed_err = rel(stock[key], reference[key]), rel(packed[key], reference[key])
        row |= {f"{key}_stock_bf16_vs_fp32_rel": stock_err, f"{key}_swap_bf16_vs_fp32_rel": packed_err,
                f"{key}_swap_vs_stock_rel": rel(packed[key], stock[key]), f"{key}_tolerance": 2 * stock_err + 1e-2}
        grads_pass &= packed_err <= 2 * stock_err + 1e-2
    row |= {"paths_run": ran, "tokens": tokens, "expert_values": values,
            "model_gib_stock": stock_bytes / 2**30, "model_gib_packed": packed_bytes / 2**30,
            "model_gib_saved_expected": values * (2 - 17 / 32) / 2**30,
            "extra_peak_gib_stock": stock["extra_peak_gib"], "extra_peak_gib_packed": packed["extra_peak_gib"],
            "packed": summary}
    row["pass"] = bool(row["pass"] and grads_pass and ran == ["grouped_mm, compiled decode, eager glue"]
                       and stock_bytes - packed_bytes == values * 2 - values * 17 // 32)
    rows.append(row)

    # One layer's experts alone, 8192 tokens routed to 4 of 32 experts: the bf16 grouped GEMMs against the packed
    # path (a decode in the forward, one in the backward; each decoder against dequantize_mxfp4: check_mxfp4_decode.py),
    # its glue eager and compiled.
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = packed_model.model.layers[0].mlp.experts  # peft injected LoRA into the model in place
    hidden = torch.randn(8192, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    top, index = torch.randn(8192, config.num_local_experts, device="cuda").topk(config.num_experts_per_tok, dim=-1)
    weights = top.softmax(-1).to(torch.bfloat16)
    bf16 = copy.deepcopy(experts)
    for name in ("gate_up_proj", "down_proj"):  # the 16-bit weights back, [E, in, out], for the stock path
        blocks, scales = getattr(bf16, f"{name}_blocks"), getattr(bf16, f"{name}_scales")
        weight = expert_from_disk(blocks, scales).contiguous()  # [E, in, out], as the loaded model holds it
        bf16.register_parameter(name, torch.nn.Parameter(weight, requires_grad=False))

    def output_and_input_grad(run):
        hidden.grad = None
        out = run()
        out.float().sum().backward()
        return out.detach().float(), hidden.grad.float().clone()

    def packed_experts(glue):
        with forced_path(glue=glue):
            return grouped_mm_mxfp4_experts_forward(experts, hidden, index, weights)

    stock_out, stock_grad = output_and_input_grad(lambda: grouped_mm_experts_forward(bf16, hidden, index, weights))
    packed_out, packed_grad = output_and_input_grad(lambda: packed_experts("eager"))
    glue_out, glue_grad = output_and_input_grad(lambda: packed_experts("compiled"))
    diffs = {"output_rel_diff": rel(packed_out, stock_out), "input_grad_rel_diff": rel(packed_grad, stock_grad),
             "compiled_glue_vs_eager_output_rel": rel(glue_out, packed_out),
             "compiled_glue_vs_eager_input_grad_rel": rel(glue_grad, packed_grad)}
    rows.append({"check": "gpt-oss experts alone (one layer, 8192 tokens, bf16): grouped_mm_mxfp4 vs grouped_mm",
                 **diffs, "tolerance": "relative difference at most 8e-3 (two bf16 roundings)",
                 "pass": all(diff <= 8e-3 for diff in diffs.values())})


CHECKS = {"generation": check_generation, "liger": check_liger, "mxfp4_experts": check_mxfp4_experts,
          "padding-free": check_padding_free, "varlen_attention": check_varlen_attention,
          "varlen_kernels": check_varlen_kernels, "varlen_sinks": check_varlen_sinks}


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
