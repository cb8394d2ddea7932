"""gpt-oss's frozen experts kept in MXFP4 while training (model.experts_implementation grouped_mm_mxfp4): the
re-encoding is lossless, the packed forward and its input gradients are those of the 16-bit experts, the memory
goes, autograd keeps no 16-bit expert weight, and validate refuses what it cannot run.

Tolerances against the unpacked model: the packed path decodes exactly the values the 16-bit weights hold, and runs
the same operations in the same order; only the weight's memory layout in the matmuls differs ([experts, out, in]
read transposed instead of [experts, in, out]), which may change the order in which a matmul sums its products. In
float32 that moves a result by a few ulps: rtol 1e-5 (atol 1e-6 for values near 0). In bfloat16 each matmul output
rounds once to 8 bits of mantissa, so a different summation order can move it by one bf16 ulp (2**-8 = 3.9e-3
relative), carried through the layers: rtol 1e-2, atol 1e-3 on outputs of order 0.1-1. On this CPU the two agree
bit for bit; the tolerances are what may differ elsewhere, not what is seen here.
"""
import copy
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from helpers import build_tiny_gpt_oss, shipped
from lora_pipeline.families.gpt_oss.rules import MXFP4_EXPERTS, packing_problems
from lora_pipeline.model.loading import experts_implementation, load_model, set_experts_implementation
from lora_pipeline.families.gpt_oss.mxfp4 import E8M0_BIAS, dequantize_mxfp4, quantize_mxfp4
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import _read, expert_from_disk
from lora_pipeline.model.checkpoint_files import tensor_files
from lora_pipeline.families.gpt_oss.mxfp4_experts import (PATHS, decode_weight, decoder_for, down_glue, forced_path,
                                                          gate_up_glue, glue_for, pack_experts, paths_run)

VOCAB, HIDDEN, INTERMEDIATE, EXPERTS, LAYERS = 128, 64, 96, 4, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-6), "bfloat16": dict(rtol=1e-2, atol=1e-3)}
# The expert weights as parameters ([E, in, out]), as stored ([E, out, in]), and one expert's slice of each.
WEIGHT_SHAPES = {(EXPERTS, HIDDEN, 2 * INTERMEDIATE), (EXPERTS, 2 * INTERMEDIATE, HIDDEN),
                 (EXPERTS, INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)}
WEIGHT_SHAPES |= {shape[1:] for shape in WEIGHT_SHAPES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny gpt-oss written as an MXFP4 checkpoint: loaded, its expert weights are MXFP4 values."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    build_tiny_gpt_oss(folder, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_local_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=LAYERS, sliding_window=16)
    return folder


def load(folder, dtype: str, experts: str = "grouped_mm"):
    params = SimpleNamespace(dtype=dtype, attn_implementation="eager", experts_implementation=experts,
                             trust_remote_code=False)
    return load_model(folder, params, SimpleNamespace(method="mxfp4-dequantize"))


def packed(folder, dtype: str):
    model = load(folder, dtype, MXFP4_EXPERTS)
    pack_experts(model)
    return model


def memory(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_loaded_expert_weights_round_trip_exactly_and_match_the_checkpoint(tiny_dir, dtype):
    model = load(tiny_dir, dtype)
    files = tensor_files(tiny_dir)
    for name, weight in model.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        on_disk = weight.detach().transpose(1, 2)  # [E, out, in], blocks along `in`
        decoded = dequantize_mxfp4(*quantize_mxfp4(on_disk), dtype=weight.dtype)
        assert torch.equal(decoded, on_disk), name
        # and the values are the checkpoint's (the bytes may differ: a group whose largest value is 3 * 2**e is
        # written back with the scale 2**(e-1), 6 * 2**(e-1), the same values)
        stored = dequantize_mxfp4(_read(files, f"{name}_blocks"), _read(files, f"{name}_scales"), dtype=weight.dtype)
        assert torch.equal(stored, on_disk), name
    pack_experts(model)
    for name, buffer in model.named_buffers():
        if name.endswith("_blocks"):
            scales = dict(model.named_buffers())[name[:-len("_blocks")] + "_scales"]
            stored = dequantize_mxfp4(_read(files, name), _read(files, name[:-len("_blocks")] + "_scales"))
            assert torch.equal(dequantize_mxfp4(buffer, scales), stored), name


def test_packing_refuses_weights_that_are_not_mxfp4_values(tiny_dir):
    model = load(tiny_dir, "float32")
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.down_proj[2, 5, 7] += 1e-3  # off the grid
    with pytest.raises(ValueError, match=r"model\.experts_implementation: grouped_mm_mxfp4: "
                                         r"model\.layers\.1\.mlp\.experts\.down_proj, expert 2: 1 of 6144 values "
                                         r"change .* allowed: grouped_mm"):
        pack_experts(model)


def test_packing_refuses_lora_on_the_experts_and_models_without_them(tiny_dir):
    with pytest.raises(ValueError, match=r"model\.experts_implementation: grouped_mm_mxfp4 freezes the experts in "
                                         r"MXFP4, but lora\.target_parameters \['mlp\.experts\.gate_up_proj'\]"):
        pack_experts(load(tiny_dir, "float32"), ["mlp.experts.gate_up_proj"])
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"the base model \(qwen2\) is not gpt-oss; allowed: eager, grouped_mm"):
        pack_experts(qwen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_experts_hold_no_float_weights_and_free_the_expected_bytes(tiny_dir, dtype):
    model = load(tiny_dir, dtype)
    before = memory(model)
    summary = pack_experts(model)
    values = LAYERS * EXPERTS * 3 * HIDDEN * INTERMEDIATE  # gate_up H x 2I and down I x H, per expert and layer
    size = DTYPES[dtype].itemsize
    # each value: `size` bytes as a weight; packed half a byte plus one scale byte per 32 values
    assert summary == {"modules": LAYERS, "values": values, "bytes_before": values * size,
                       "bytes_after": values // 2 + values // 32}
    assert before - memory(model) == values * size - values * 17 // 32
    assert experts_implementation(model) == MXFP4_EXPERTS
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert sorted(n for n, _ in experts.named_parameters()) == ["down_proj_bias", "gate_up_proj_bias"]
        assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
        assert {n: (tuple(b.shape), b.dtype) for n, b in experts.named_buffers()} == {
            "gate_up_proj_blocks": ((EXPERTS, 2 * INTERMEDIATE, HIDDEN // 32, 16), torch.uint8),
            "gate_up_proj_scales": ((EXPERTS, 2 * INTERMEDIATE, HIDDEN // 32), torch.uint8),
            "down_proj_blocks": ((EXPERTS, HIDDEN, INTERMEDIATE // 32, 16), torch.uint8),
            "down_proj_scales": ((EXPERTS, HIDDEN, INTERMEDIATE // 32), torch.uint8)}
    assert pack_experts(model)["values"] == 0  # packed already: nothing to do


@pytest.mark.parametrize("path", PATHS)
def test_layers_kept_in_16_bits_compute_what_packed_ones_do(tiny_dir, path):
    """train.experts_kept_16bit 1 of 2 layers: the first layer's experts packed, the last one's left as the 16-bit
    parameters they loaded as; logits and gradients as with every layer packed (the same values, decoded or not)."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with forced_path(path):
        every_layer = packed(tiny_dir, "bfloat16")
        reference = lora_forward_backward(every_layer, ids)
        model = load(tiny_dir, "bfloat16", MXFP4_EXPERTS)
        summary = pack_experts(model, kept_16bit=1)
        logits, embeds_grad, grads = lora_forward_backward(model, ids)
    values = EXPERTS * 3 * HIDDEN * INTERMEDIATE  # one layer's
    assert summary == {"modules": 1, "values": values, "bytes_before": values * 2,
                       "bytes_after": values // 2 + values // 32, "kept_16bit": 1}
    first, last = (layer.mlp.experts for layer in model.model.layers)
    assert hasattr(first, "gate_up_proj_blocks") and not hasattr(first, "gate_up_proj")
    assert {n: p.dtype for n, p in last.named_parameters() if n.endswith("proj")} == {
        "gate_up_proj": torch.bfloat16, "down_proj": torch.bfloat16}
    assert not any(p.requires_grad for p in last.parameters())  # frozen, as LoRA leaves the experts
    assert paths_run(model) == [f"{path}, 16-bit weights, eager glue", f"{path}, eager decode, eager glue"]
    torch.testing.assert_close(logits, reference[0], **TOLERANCE["bfloat16"])
    torch.testing.assert_close(embeds_grad, reference[1], **TOLERANCE["bfloat16"])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[2][name], **TOLERANCE["bfloat16"], msg=lambda m: f"{name}: {m}")


def test_more_layers_kept_in_16_bits_than_the_model_has_are_refused(tiny_dir):
    model = load(tiny_dir, "bfloat16", MXFP4_EXPERTS)
    with pytest.raises(ValueError, match=rf"train\.experts_kept_16bit: 3, but the model has {LAYERS} experts "
                                         rf"modules \(one a decoder layer\); allowed: 0 to {LAYERS}"):
        pack_experts(model, kept_16bit=3)
    assert pack_experts(model, kept_16bit=LAYERS)["modules"] == 0  # every layer kept: nothing packed


def lora_forward_backward(model, ids):
    """LoRA on the attention projections (random A and B, seeded), inputs_embeds that need a gradient: the logits,
    the gradient of the embeddings and the LoRA weights' gradients after a backward of the loss."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    embeds = peft_model.get_input_embeddings()(ids).detach().requires_grad_()
    out = peft_model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert len(grads) == 4 * 2 * LAYERS and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    return out.logits.detach(), embeds.grad, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_packed_forward_and_input_gradients_match_the_unpacked_experts(tiny_dir, dtype, path):
    """Logits and the gradients of the input embeddings and of LoRA on the attention: the packed experts through
    `path` against transformers' grouped_mm and its eager loop over the same weights in the same dtype."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    unpacked = load(tiny_dir, dtype)
    references = {}
    for impl in ("grouped_mm", "eager"):
        set_experts_implementation(unpacked, impl)
        references[impl] = lora_forward_backward(copy.deepcopy(unpacked), ids)
    with forced_path(path):
        model = packed(tiny_dir, dtype)
        logits, embeds_grad, grads = lora_forward_backward(model, ids)
    assert paths_run(model) == [f"{path}, eager decode, eager glue"]
    assert logits.dtype == DTYPES[dtype]
    for impl, (ref_logits, ref_embeds_grad, ref_grads) in references.items():
        torch.testing.assert_close(logits, ref_logits, **TOLERANCE[dtype], msg=lambda m: f"{impl} logits: {m}")
        torch.testing.assert_close(embeds_grad, ref_embeds_grad, **TOLERANCE[dtype],
                                   msg=lambda m: f"{impl} input gradient: {m}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_decode_gives_the_eager_values_bit_for_bit(dtype):
    """Every byte of blocks under every scale the encoder writes (0-254; 255 is E8M0's NaN): the one-pass decode that
    Inductor compiles (the GPU's) returns what mxfp4_checkpoint.expert_from_disk returns, in the same layout."""
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # 16 rows of 16 bytes: 512 codes
    scales = torch.arange(2 * E8M0_BIAS + 1, dtype=torch.int32).to(torch.uint8)
    blocks = every_byte.repeat(len(scales), 1).reshape(len(scales), 16, 1, 16)  # [E, out, in/32, 16]
    scales = scales.reshape(-1, 1, 1).expand(-1, 16, 1).contiguous()
    compiled = decode_weight(blocks, scales, DTYPES[dtype], "compiled")
    eager = expert_from_disk(blocks, scales, DTYPES[dtype])
    assert compiled.shape == eager.shape == (len(scales), 32, 16) and compiled.stride() == eager.stride()
    bits = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(compiled.contiguous().view(bits), eager.contiguous().view(bits))
    assert decode_weight(blocks, scales, DTYPES[dtype], "eager").equal(eager)


def test_packed_experts_train_alike_with_either_decoder(tiny_dir):
    """bfloat16, grouped_mm: the compiled decode gives the logits and every gradient of the eager one, bit for bit
    (the same weights go into the same matmuls)."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    runs = {}
    for decoder in ("eager", "compiled"):
        with forced_path("grouped_mm", decoder):
            model = packed(tiny_dir, "bfloat16")
            runs[decoder] = lora_forward_backward(model, ids)
        assert paths_run(model) == [f"grouped_mm, {decoder} decode, eager glue"]
    (logits, embeds_grad, grads), (ref_logits, ref_embeds_grad, ref_grads) = runs["compiled"], runs["eager"]
    assert torch.equal(logits, ref_logits) and torch.equal(embeds_grad, ref_embeds_grad)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_glue_written_out_is_gpt_oss_own(tiny_dir, dtype):
    """gate_up_glue is GptOssExperts._apply_gate after the bias, and down_glue the grouped path's weighting and
    unsorting, bit for bit, uncompiled: a change in transformers' GLU fails here."""
    experts = load(tiny_dir, dtype).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(4)
    rows, top_k = 12, 2
    ids = torch.randint(0, EXPERTS, (rows,), generator=generator).sort().values
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=generator) * 8).to(DTYPES[dtype])  # beyond the clamp
    want = experts._apply_gate(gate_up + experts.gate_up_proj_bias[ids])
    assert torch.equal(gate_up_glue(gate_up, experts.gate_up_proj_bias, ids, experts.limit, experts.alpha), want)
    down = torch.randn(rows, HIDDEN, generator=generator).to(DTYPES[dtype])
    weights = torch.rand(rows, generator=generator).to(DTYPES[dtype])
    inverse = torch.randperm(rows, generator=generator)
    weighted = ((down + experts.down_proj_bias[ids]) * weights.unsqueeze(-1))[inverse]
    assert torch.equal(down_glue(down, experts.down_proj_bias, ids, weights, inverse, top_k),
                       weighted.view(rows // top_k, top_k, HIDDEN).sum(dim=1))


def relative_error(x, reference) -> float:
    return ((x.float() - reference.float()).norm() / reference.float().norm()).item()


def outputs(run) -> list[torch.Tensor]:
    """lora_forward_backward's logits, input gradient and LoRA gradients (in the model's parameter order)."""
    logits, embeds_grad, grads = run
    return [logits, embeds_grad, *grads.values()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_glue_trains_as_the_eager_one(tiny_dir, dtype):
    """The glue compiled by Inductor (dynamic row counts, forward and backward fused) against the eager glue, over
    two row counts. float32: logits and gradients within the tolerances above. bfloat16: the fused kernel rounds
    once where the torch ops round after each, so values move by a bf16 ulp or two through the layers; its error
    against the float32 model is held to at most twice the eager glue's own, plus 1e-3 (as the GPU checks hold a
    kernel swap)."""
    reference = packed(tiny_dir, "float32")
    model = packed(tiny_dir, dtype)
    for length in (9, 13):  # two row counts: one compile, dynamic in the rows
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        runs = {}
        for glue in ("eager", "compiled"):
            copied = copy.deepcopy(model)
            with forced_path("grouped_mm", "eager", glue):
                runs[glue] = lora_forward_backward(copied, ids)
            assert paths_run(copied) == [f"grouped_mm, eager decode, {glue} glue"]
        if dtype == "float32":
            for compiled, eager in zip(outputs(runs["compiled"]), outputs(runs["eager"])):
                torch.testing.assert_close(compiled, eager, **TOLERANCE[dtype])
            continue
        with forced_path("grouped_mm", "eager", "eager"):
            exact = lora_forward_backward(copy.deepcopy(reference), ids)
        for compiled, eager, want in zip(outputs(runs["compiled"]), outputs(runs["eager"]), outputs(exact)):
            assert relative_error(compiled, want) <= 2 * relative_error(eager, want) + 1e-3


def test_forced_path_names_what_it_accepts():
    with pytest.raises(ValueError, match="decoder must be one of"):
        with forced_path(decoder="cutlass"):
            pass
    with pytest.raises(ValueError, match="glue must be one of"):
        with forced_path(glue="triton"):
            pass
    with pytest.raises(ValueError, match="path must be one of"):
        with forced_path("cutlass"):
            pass


def test_the_packed_weights_are_what_runs(tiny_dir):
    """Zeroed packed blocks (every weight 0) leave only the biases: the output comes from the packed bytes."""
    model = packed(tiny_dir, "float32")
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    index, weights = torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5)
    before = experts(hidden, index, weights)
    experts.gate_up_proj_blocks.zero_()
    experts.down_proj_blocks.zero_()
    zeroed = experts(hidden, index, weights)
    assert not torch.allclose(before, zeroed)
    torch.testing.assert_close(zeroed, (experts.down_proj_bias[[0, 1]] * 0.5).sum(0).expand(5, -1), rtol=0, atol=0)


def saved_during_forward(model, ids) -> list[tuple[tuple, torch.dtype]]:
    """The shape and dtype of every tensor autograd saves for the backward during a training forward."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=embeds, labels=ids).loss.backward()
    return saved


@pytest.mark.parametrize("path", PATHS)
def test_autograd_keeps_no_float_expert_weight(tiny_dir, path):
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))  # 28 rows: no weight's size
    for impl in ("grouped_mm", "eager"):  # the unpacked experts keep their weights (or slices) for the backward
        unpacked = load(tiny_dir, "bfloat16", impl)
        assert {s for s, dtype in saved_during_forward(unpacked, ids) if dtype.is_floating_point} & WEIGHT_SHAPES
    with forced_path(path):
        model = packed(tiny_dir, "bfloat16")
        saved = saved_during_forward(model, ids)
    assert paths_run(model) == [f"{path}, eager decode, eager glue"]
    assert not {s for s, dtype in saved if dtype.is_floating_point} & WEIGHT_SHAPES
    assert ((EXPERTS, 2 * INTERMEDIATE, HIDDEN // 32, 16), torch.uint8) in saved  # what it keeps instead


def test_the_loader_runs_grouped_mm_until_the_train_stage_packs(tiny_dir):
    """Loads to evaluate, merge or serve with grouped_mm_mxfp4 asked run grouped_mm over the 16-bit experts."""
    model = load(tiny_dir, "float32", MXFP4_EXPERTS)
    assert experts_implementation(model) == "grouped_mm"
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32


def test_train_stage_trains_lora_over_packed_experts_as_over_16_bit_ones(tiny_dir, tmp_path):
    """build_trainer with grouped_mm_mxfp4: the experts packed before LoRA, DDP told not to broadcast them, two
    optimizer steps (with and without recompute) that change the LoRA weights as the 16-bit grouped_mm experts do
    and leave the packed bytes."""
    import yaml
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lora_pipeline.config.params import for_stage, validate
    from cli.recipes import apply_sets
    from lora_pipeline.train.training import build_trainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="<eos>")
    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    tokenizer.save_pretrained(base)
    rows = Dataset.from_list([{"input_ids": [(7 * i + j) % (VOCAB - 2) + 2 for j in range(12 + i)]} for i in range(16)])
    adapters = {}
    runs = {"grouped_mm": [], MXFP4_EXPERTS: [], "recompute": ["train.sft.gradient_checkpointing=true"]}
    for name, sets in runs.items():
        experts = "grouped_mm" if name == "grouped_mm" else MXFP4_EXPERTS
        raw = apply_sets(yaml.safe_load((ROOT / "params.yaml").read_text()), [
            "train.checkpoint_steps=0", "train.sft.max_steps=2", "train.sft.warmup_steps=0",
            "train.sft.per_device_train_batch_size=8", "lora.lora_dropout=0.0", "train.sft.assistant_only_loss=false",
            "quantization.method=mxfp4-dequantize", f"model.experts_implementation={experts}", *sets])
        params = for_stage(validate(raw), "test", ["model", "quantization", "train", "lora"])
        trainer, record = build_trainer(params, base, rows, tmp_path / name)
        assert record["experts"] == experts and record["gradient_checkpointing"] == bool(sets)
        if experts == MXFP4_EXPERTS:
            assert record["packed_experts"]["modules"] == LAYERS
            assert record["packed_experts"]["ddp_broadcast_buffers"] is False
            blocks = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith(("_blocks", "_scales"))}
            assert len(blocks) == 4 * LAYERS
        else:
            assert "packed_experts" not in record and trainer.args.ddp_broadcast_buffers is None
        trainer.train()
        assert trainer.state.global_step == 2
        adapters[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        if experts == MXFP4_EXPERTS:
            assert all(torch.equal(b, dict(trainer.model.named_buffers())[n]) for n, b in blocks.items())
            assert paths_run(trainer.model) == ["grouped_mm, eager decode, eager glue"]
    for name in (MXFP4_EXPERTS, "recompute"):
        assert adapters[name].keys() == adapters["grouped_mm"].keys()
        for key, weight in adapters["grouped_mm"].items():
            torch.testing.assert_close(adapters[name][key], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_packing_problems_name_the_key_and_the_way_on():
    assert packing_problems("gpt_oss", "mxfp4", []) == []
    assert packing_problems(None, None, ["self_attn.q_proj.weight"]) == []  # a Hub model before fetch
    (line,) = packing_problems("qwen2", None, [])
    assert line.startswith("model.experts_implementation: grouped_mm_mxfp4") and "(qwen2) is not gpt-oss" in line
    (line,) = packing_problems("gpt_oss", "none", [])
    assert "stores no MXFP4 weights" in line and "allowed: grouped_mm" in line
    (line,) = packing_problems("gpt_oss", "mxfp4", ["mlp.experts.gate_up_proj", "down_proj", "mlp.router.weight"])
    assert "lora.target_parameters ['mlp.experts.gate_up_proj', 'down_proj'] trains them" in line


GPT_OSS = {"model.source": "tiny-gpt-oss", "quantization.method": "mxfp4-dequantize", "lora.lora_dropout": 0.0,
           "model.experts_implementation": MXFP4_EXPERTS}


@pytest.mark.parametrize("changes, fragment", [
    ({"model.experts_implementation": MXFP4_EXPERTS}, "is not gpt-oss"),  # tiny-qwen2
    ({**GPT_OSS, "lora.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
     "but lora.target_parameters ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] trains them; allowed"),
    ({**GPT_OSS, "train.accelerate_config": "fsdp2"}, "(FSDP): the packed experts are buffers"),
], ids=["not-gpt-oss", "lora-on-experts", "fsdp2"])
def test_validate_refuses_packed_experts_where_they_cannot_run(monkeypatch, changes, fragment):
    from lora_pipeline.validation.all_checks import validate_all
    from lora_pipeline.config.params import ParamsError

    monkeypatch.chdir(ROOT)
    with pytest.raises(ParamsError) as refused:
        validate_all(shipped(**changes))
    lines = [line.strip() for line in str(refused.value).splitlines()]
    assert any(line.startswith(f"model.experts_implementation: {MXFP4_EXPERTS}") and fragment in line
               for line in lines), lines


@pytest.mark.parametrize("changes, message", [
    ({**GPT_OSS, "train.experts_kept_16bit": 3},
     "train.experts_kept_16bit: 3, but the base model has 2 decoder layers; allowed: 0 to 2"),
    ({**GPT_OSS, "model.experts_implementation": "grouped_mm", "train.experts_kept_16bit": 1},
     "train.experts_kept_16bit: 1 keeps layers out of the MXFP4 packing, but model.experts_implementation is "
     "grouped_mm, which packs nothing; allowed: 0, or model.experts_implementation grouped_mm_mxfp4"),
], ids=["more-than-the-layers", "nothing-packed"])
def test_validate_refuses_layers_kept_in_16_bits_that_cannot_be(monkeypatch, changes, message):
    from lora_pipeline.validation.all_checks import validate_all
    from lora_pipeline.config.params import ParamsError

    monkeypatch.chdir(ROOT)
    with pytest.raises(ParamsError) as refused:
        validate_all(shipped(**changes))
    assert message in [line.strip() for line in str(refused.value).splitlines()]
    assert validate_all(shipped(**{**GPT_OSS, "train.experts_kept_16bit": 2})).train.experts_kept_16bit == 2


def test_validate_refuses_packed_experts_of_a_base_without_mxfp4(monkeypatch, tmp_path):
    from transformers import AutoConfig

    from lora_pipeline.validation.all_checks import validate_all
    from lora_pipeline.config.params import ParamsError

    monkeypatch.chdir(ROOT)
    AutoConfig.for_model("gpt_oss", num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4).save_pretrained(tmp_path)  # a bf16 gpt-oss
    local = {"model.source": "local", "model.name": str(tmp_path), "lora.lora_dropout": 0.0,
             "model.experts_implementation": MXFP4_EXPERTS}
    with pytest.raises(ParamsError, match=r"model\.experts_implementation: grouped_mm_mxfp4 re-encodes experts loaded "
                                          r"from MXFP4, but the base model stores no MXFP4 weights"):
        validate_all(shipped(**local))


def test_validate_accepts_packed_experts_of_tiny_gpt_oss(monkeypatch):
    from lora_pipeline.validation.all_checks import validate_all

    monkeypatch.chdir(ROOT)
    assert validate_all(shipped(**GPT_OSS)).model.experts_implementation == MXFP4_EXPERTS


@pytest.mark.parametrize("triton", [True, False])
def test_a_gpu_compiles_the_decode_and_the_glue_a_cpu_runs_them_eagerly_unless_forced(monkeypatch, triton):
    """A GPU decodes with the Triton kernel where Triton is installed, else with the compiled pass."""
    from lora_pipeline.families.gpt_oss import mxfp4_triton

    monkeypatch.setattr(mxfp4_triton, "available", lambda: triton)
    gpu_decoder = "triton" if triton else "compiled"
    for choose, forced, on_gpu in ((decoder_for, {"decoder": "compiled"}, gpu_decoder),
                                   (glue_for, {"glue": "compiled"}, "compiled")):
        assert (choose(torch.device("cuda")), choose(torch.device("cpu"))) == (on_gpu, "eager")
        with forced_path(**forced):
            assert (choose(torch.device("cuda")), choose(torch.device("cpu"))) == ("compiled", "compiled")


def test_the_triton_decoder_names_what_it_needs():
    from lora_pipeline.families.gpt_oss import mxfp4_triton

    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blocks must be \[\.\.\., G, 16\]"):
        mxfp4_triton.decode(blocks[..., :8], scales, torch.bfloat16)
    with pytest.raises(RuntimeError, match="on a GPU"):
        mxfp4_triton.decode(blocks, scales, torch.bfloat16)


def test_the_decoders_gpu_check_compares_bit_for_bit_and_fails_on_one_bit(monkeypatch, capsys):
    """benchmarks/check_mxfp4_decode.py on the CPU at a reduced size: the eager decoder passes, and a decoder that
    flips one bit of one value makes the check exit non-zero."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import check_mxfp4_decode

    small = ["--device", "cpu", "--experts", "2", "--hidden", "64", "--decoders", "eager"]
    check_mxfp4_decode.main(small)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["weight"], row["bitwise_equal"]) for row in rows] == [("gate_up_proj", True), ("down_proj", True)]

    def one_bit_off(*args):
        bits = decode_weight(*args).contiguous().view(torch.int16)
        bits.view(-1)[7] ^= 1
        return bits.view(torch.bfloat16)

    monkeypatch.setattr(check_mxfp4_decode, "decode_weight", one_bit_off)
    with pytest.raises(SystemExit, match="differs from dequantize_mxfp4"):
        check_mxfp4_decode.main(small)
