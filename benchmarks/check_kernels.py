"""GPU check of every kernel swap the speed levers make, against the stock path, on small models of the real
architectures (random init, fresh random inputs each run).

    python benchmarks/check_kernels.py --out kernel_checks.json [--only generation ...]
Checks, each as max |logit diff| and |loss diff| against a float32 eager reference and against the bf16 stock path:
  - gpt-oss attention: flex_attention (sinks renormalised by the log-sum-exp) vs eager;
  - gpt-oss experts: grouped_mm vs the eager per-expert loop;
  - Liger (RMSNorm, RoPE, fused linear cross-entropy) vs stock, loss and LoRA gradients;
  - padding-free (rows concatenated, position_ids) vs padded rows: the same per-token loss;
  - compiled_layers: Qwen2 with LoRA (bf16, flex attention, padding-free rows with a padded tail), each decoder
    layer compiled by Inductor (lora_pipeline.train.training.compile_decoder_layers) vs eager: logits, loss and the LoRA
    gradients against float32 eager, for two packed lengths (the second compiles a graph over a symbolic length);
  - varlen_attention: the same Qwen2 LoRA rows under torch_varlen (torch's FlashAttention kernel for
    variable-length sequences, lora_pipeline.model.varlen_attention), layers eager and compiled, vs eager flex
    attention;
  - varlen_sinks: the same for a 2-layer gpt-oss (a sliding-window and a full layer, sinks away from zero, attention
    LoRA), its sinks folded around the kernel, vs bf16 flex attention and float32 eager (their masks built from the
    position_ids, as train builds them: lora_pipeline.families.gpt_oss.packed_masks.mask_packed_rows);
  - generation: the implementations evaluate decodes with (lora_pipeline.evaluate.generation.use_for_generation, from
    a model loaded as the recipes train it), greedy with a KV cache after left-padded prompts; each step's logits
    against a float32 forward over the same tokens with eager attention and the eager experts loop;
  - mxfp4_experts: gpt-oss's frozen experts packed in MXFP4 (grouped_mm_mxfp4,
    lora_pipeline.families.gpt_oss.mxfp4_experts) vs the bf16 grouped_mm path over the same MXFP4 values, 2 layers
    of gpt-oss-20b's shapes: logits, loss, the input embeddings' and attention LoRA's gradients, the model's bytes,
    the extra peak memory of a forward + backward and its time; and one layer's experts alone (forward + backward,
    8192 tokens), with the time of one weight decode.
bf16 tolerance: a swap passes when its error against the float32 reference is at most 2x the stock bf16 path's
own error plus 1e-2 (bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding); for gradients the same on the
relative norm of the error.
"""
import argparse
import copy
import json

import torch


def small_gpt_oss(attn="eager", experts="eager", experts_per_token=2):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=experts_per_token, vocab_size=4096,
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
    from lora_pipeline.model.loading import set_experts_implementation

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


def check_compiled_layers(rows):
    packed_lora(rows, "compiled decoder layers", {"compiled": ("flex_attention", "default")})


def check_varlen_attention(rows):
    packed_lora(rows, "torch's varlen FlashAttention", {"varlen": ("torch_varlen", "none"),
                                                        "varlen-compiled": ("torch_varlen", "default")})


def check_varlen_sinks(rows):
    """The small gpt-oss with LoRA over packed rows (packed_lora); the kernel pair and the folded sinks alone are
    benchmarks/check_varlen_sinks.py's."""
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


def timed_ms(step, repeats=5) -> float:
    """The median wall time of `step()` on the GPU, after one warm-up call."""
    import statistics
    import time

    step()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def lora_pass(model, ids):
    """LoRA (r 8, random A and B, seeded) on the attention projections, input embeddings that need a gradient: the
    logits, loss, the embeddings' and LoRA's gradients of one forward + backward, the extra peak memory it takes
    over what was allocated before it (activations and transients, GiB) and its median time (ms)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    lora = [p for p in peft_model.parameters() if p.requires_grad]
    embeds = peft_model.get_input_embeddings()(ids).detach().requires_grad_()

    def step():
        embeds.grad = None
        for p in lora:
            p.grad = None
        out = peft_model(inputs_embeds=embeds, labels=ids)
        out.loss.backward()
        return out

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    extra_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    result = {"logits": out.logits.detach().float(), "loss": out.loss.detach().float(),
              "embeds_grad": embeds.grad.float().clone(),
              "lora_grads": torch.cat([p.grad.flatten().float() for p in lora]), "extra_peak_gib": extra_gib}
    del out
    result["ms"] = timed_ms(step)
    return result


def check_mxfp4_experts(rows, layers=2, tokens=2048):
    """grouped_mm_mxfp4 against the bf16 grouped_mm path, gpt-oss-20b's widths (hidden and intermediate 2880, 32
    experts, top 4) over `layers` layers, the same MXFP4 values in both; reference: the same model in float32 with
    the eager experts loop."""
    from pipeline_setup import gpt_oss_20b_config, random_bf16_model  # benchmarks/, the script's folder

    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk
    from lora_pipeline.families.gpt_oss.mxfp4_experts import (decode_weight, forced_path,
                                                              grouped_mm_mxfp4_experts_forward, pack_experts,
                                                              paths_run)

    config = gpt_oss_20b_config(layers, vocab_size=4096)
    torch.manual_seed(0)
    base = random_bf16_model(config, "cuda")
    with torch.no_grad():
        for layer in base.model.layers:  # sinks away from zero, as the attention check has them
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
            "forward_backward_ms_stock": stock["ms"], "forward_backward_ms_packed": packed["ms"], "packed": summary}
    row["pass"] = bool(row["pass"] and grads_pass and ran == ["grouped_mm, compiled decode, eager glue"]
                       and stock_bytes - packed_bytes == values * 2 - values * 17 // 32)
    rows.append(row)

    # One layer's experts alone, 8192 tokens routed to 4 of 32 experts: the bf16 grouped GEMMs against the packed
    # path (a decode in the forward, one in the backward) with each decoder, and one decode of gate_up_proj.
    experts = packed_model.model.layers[0].mlp.experts  # peft injected LoRA into the model in place
    hidden = torch.randn(8192, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(8192, config.num_local_experts, device="cuda")
    top, index = logits.topk(config.num_experts_per_tok, dim=-1)
    weights = top.softmax(-1).to(torch.bfloat16)
    bf16 = copy.deepcopy(experts)
    for name in ("gate_up_proj", "down_proj"):  # the 16-bit weights back, [E, in, out], for the stock path
        blocks, scales = getattr(bf16, f"{name}_blocks"), getattr(bf16, f"{name}_scales")
        weight = expert_from_disk(blocks, scales).contiguous()  # [E, in, out], as the loaded model holds it
        bf16.register_parameter(name, torch.nn.Parameter(weight, requires_grad=False))
    from transformers.integrations.moe import grouped_mm_experts_forward

    def stock_step():
        hidden.grad = None
        grouped_mm_experts_forward(bf16, hidden, index, weights).float().sum().backward()

    def packed_forward(glue="eager"):
        with forced_path(glue=glue):
            return grouped_mm_mxfp4_experts_forward(experts, hidden, index, weights)

    def packed_step(glue="eager"):
        hidden.grad = None
        packed_forward(glue).float().sum().backward()

    stock_step()
    stock_out, stock_grad = grouped_mm_experts_forward(bf16, hidden, index, weights).detach(), hidden.grad.clone()
    packed_step()
    packed_out, packed_grad = packed_forward().detach(), hidden.grad.clone()
    gate_up = experts.gate_up_proj_blocks, experts.gate_up_proj_scales
    decoded = {d: decode_weight(*gate_up, torch.bfloat16, d) for d in ("compiled", "eager")}
    decode_ms = {d: timed_ms(lambda d=d: decode_weight(*gate_up, torch.bfloat16, d)) for d in decoded}
    with forced_path(decoder="eager"):
        eager_step_ms = timed_ms(packed_step)
    packed_step("compiled")
    glue_out, glue_grad = packed_forward("compiled").detach(), hidden.grad.clone()
    glue_step_ms = timed_ms(lambda: packed_step("compiled"))
    glue_out_rel, glue_grad_rel = rel(glue_out.float(), packed_out.float()), rel(glue_grad.float(), packed_grad.float())
    out_rel, grad_rel = rel(packed_out.float(), stock_out.float()), rel(packed_grad.float(), stock_grad.float())
    same_decode = torch.equal(decoded["compiled"].contiguous().view(torch.int16),
                              decoded["eager"].contiguous().view(torch.int16))
    rows.append({"check": "gpt-oss experts alone (one layer, 8192 tokens, bf16): grouped_mm_mxfp4 vs grouped_mm",
                 "output_rel_diff": out_rel, "input_grad_rel_diff": grad_rel,
                 "forward_backward_ms_stock": timed_ms(stock_step), "forward_backward_ms_packed": timed_ms(packed_step),
                 "forward_backward_ms_packed_eager_decode": eager_step_ms,
                 "forward_backward_ms_packed_compiled_glue": glue_step_ms,
                 "compiled_glue_vs_eager_output_rel": glue_out_rel,
                 "compiled_glue_vs_eager_input_grad_rel": glue_grad_rel,
                 "decode_gate_up_ms_compiled": decode_ms["compiled"], "decode_gate_up_ms_eager": decode_ms["eager"],
                 "decoders_bit_identical": same_decode,
                 "tolerance": "relative difference at most 8e-3 (two bf16 roundings); decoders bit for bit",
                 "pass": bool(out_rel <= 8e-3 and grad_rel <= 8e-3 and same_decode and glue_out_rel <= 8e-3
                              and glue_grad_rel <= 8e-3)})


CHECKS = {"compiled_layers": check_compiled_layers, "generation": check_generation, "gpt-oss": check_gpt_oss,
          "liger": check_liger, "mxfp4_experts": check_mxfp4_experts, "padding-free": check_padding_free,
          "varlen_attention": check_varlen_attention, "varlen_sinks": check_varlen_sinks}


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
