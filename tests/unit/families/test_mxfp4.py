"""Tests of the MXFP4 codec and checkpoints: tiny gpt-oss checkpoints, dequantized loading and LoRA training."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from helpers import build_tiny_gpt_oss
from lora_pipeline.model.loading import load_model
from lora_pipeline.families.gpt_oss.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_dequantized, save_mxfp4_checkpoint

VOCAB = 96
# As the recipe loads openai/gpt-oss-20b: bf16, MXFP4 experts dequantized (the pipeline's one loader).
BF16 = SimpleNamespace(dtype="bfloat16", attn_implementation="sdpa", experts_implementation="eager",
                       trust_remote_code=False)
FP32 = SimpleNamespace(dtype="float32", attn_implementation="sdpa", experts_implementation="eager",
                       trust_remote_code=False)
DEQUANTIZE = SimpleNamespace(method="mxfp4-dequantize")


def load_mxfp4_dequantized(path, dtype=torch.bfloat16):
    return load_model(path, FP32 if dtype == torch.float32 else BF16, DEQUANTIZE)
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _representable(shape, seed):
    """Random e2m1 codes times a random power of two per group of 32; each group holds a +-6 (code 7/15)."""
    g = torch.Generator().manual_seed(seed)
    *prefix, k = shape
    groups = k // 32
    codes = torch.randint(0, 15, (*prefix, groups, 32), generator=g)
    codes = codes + (codes >= 8).long()  # skip code 8 (-0.0): the encoder stores zeros as +0
    first = torch.randint(0, 2, (*prefix, groups), generator=g) * 8 + 7  # +6 or -6 somewhere in the group
    pos = torch.randint(0, 32, (*prefix, groups, 1), generator=g)
    codes.scatter_(-1, pos, first.unsqueeze(-1))
    exps = torch.randint(-100, 100, (*prefix, groups, 1), generator=g)
    values = torch.ldexp(torch.tensor(FP4_VALUES)[codes], exps.float())
    return values.reshape(shape), codes, exps.squeeze(-1)


def test_representable_values_round_trip_exactly_and_encode_canonically():
    w, codes, exps = _representable((3, 5, 128), seed=1)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (3, 5, 4, 16) and scales.shape == (3, 5, 4)
    # Every group holds a +-6, so the scale and codes are unique: check the exact bytes (low nibble first).
    assert torch.equal(scales.long(), exps + 127)
    assert torch.equal(blocks.long(), codes[..., 0::2] | (codes[..., 1::2] << 4))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=dtype), w.to(dtype))
        # bf16 input encodes the same way (the values have 2 significant bits)
        assert torch.equal(quantize_mxfp4(w.to(dtype))[0], blocks)


def test_representable_values_without_a_six_still_round_trip_exactly():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 7, (64, 64), generator=g)  # max |value| < 6: the encoder picks a smaller scale
    w = torch.ldexp(torch.tensor(FP4_VALUES)[codes], torch.randint(-30, 30, (64, 2, 1), generator=g).float()
                    .expand(64, 2, 32).reshape(64, 64))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w), dtype=torch.float32), w)


def test_nibble_order_and_ties_to_even():
    w = torch.zeros(32)
    w[31] = 6.0  # scale 2**0 -> byte 127
    w[0], w[1] = 0.5, 1.0  # byte 0 = code(0.5)=1 low nibble, code(1.0)=2 high nibble
    w[2], w[3] = -0.5, -6.0  # byte 1 = 9 | 15 << 4
    # ties between grid points go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0]
    w[4:12] = torch.tensor(ties)
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [127]
    assert blocks[0, 0].item() == 0x21 and blocks[0, 1].item() == 0xF9
    assert dequantize_mxfp4(blocks, scales, torch.float32)[4:12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0]
    zeros_b, zeros_s = quantize_mxfp4(torch.zeros(2, 32))
    assert zeros_b.eq(0).all() and torch.equal(dequantize_mxfp4(zeros_b, zeros_s), torch.zeros(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_normal_weights_round_trip_error(dtype):
    torch.manual_seed(3)
    w = (torch.randn(256, 512) * 0.02).to(dtype).float()
    blocks, scales = quantize_mxfp4(w.to(dtype))
    w_hat = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    rel = ((w - w_hat).norm() / w.norm()).item()
    # Measured ~0.115 for Gaussian weights (4-bit e2m1 with one power-of-two scale per 32, scale rounded up so that
    # max|w| <= 6*scale, i.e. the group max uses 3..6 of the grid). 0.13 leaves a little slack; 0.2 would hide a bug.
    assert 0.08 < rel < 0.13, rel
    # Each element went to its nearest point of its group's grid {+-0, .5, 1, 1.5, 2, 3, 4, 6} * 2**(scale-127):
    # error <= half a grid step at that point, and no clipping (max|w| <= 6 * scale).
    step = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float64)
    grid = torch.cat([grid, -grid])
    nearest = (w.double().unsqueeze(-1) - grid * step.unsqueeze(-1)).abs().amin(-1)
    err = (w.double() - w_hat.double()).abs()
    assert torch.all(err <= nearest)  # exact arithmetic in float64
    assert torch.all(err <= step)  # the widest half step (between 4 and 6) is 1 * scale
    assert torch.all(w.abs().double() <= 6 * step)
    assert torch.all(w.abs().double().view(256, 16, 32).amax(-1) > 3 * step.view(256, 16, 32)[..., 0])  # tightest


def test_dequantize_matches_transformers_convert_moe_packed_tensors_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 24, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (3, 24, 5), dtype=torch.uint8, generator=g)  # full E8M0 range, incl. 0 and 255
    scales[0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]: transposed to the param layout
        ours = dequantize_mxfp4(blocks, scales, dtype=dtype)  # [E, N, K]: on-disk layout
        assert ref.shape == (3, 160, 24) and ref.dtype == dtype
        int_view = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(ours.transpose(1, 2).contiguous().view(int_view), ref.view(int_view))


def test_bad_sizes_raise_value_error_naming_the_param(tmp_path):
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_gpt_oss(tmp_path / "a", vocab_size=VOCAB, hidden_size=48)
    with pytest.raises(ValueError, match="intermediate_size"):
        build_tiny_gpt_oss(tmp_path / "b", vocab_size=VOCAB, intermediate_size=40)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_gpt_oss(tmp_path / "c", vocab_size=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_mxfp4(torch.full((32,), float("inf")))
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_gpt_oss")
    build_tiny_gpt_oss(out, vocab_size=VOCAB, seed=0, eos_token_id=1, pad_token_id=0)
    return out


def test_tiny_checkpoint_layout(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["eos_token_id"], config["pad_token_id"]) == (1, 0)

    sd = load_file(tiny_dir / "model.safetensors")
    e, h, i = 4, 64, 64
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        # Key names and [E, out, in/32, 16] orientation of the openai/gpt-oss checkpoints.
        assert sd[p + "gate_up_proj_blocks"].dtype == torch.uint8 and sd[p + "gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
        assert sd[p + "gate_up_proj_scales"].dtype == torch.uint8 and sd[p + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
        assert sd[p + "down_proj_blocks"].dtype == torch.uint8 and sd[p + "down_proj_blocks"].shape == (e, h, i // 32, 16)
        assert sd[p + "down_proj_scales"].dtype == torch.uint8 and sd[p + "down_proj_scales"].shape == (e, h, i // 32)
        assert sd[p + "gate_up_proj_bias"].dtype == torch.bfloat16 and sd[p + "down_proj_bias"].shape == (e, h)
    assert not [k for k in sd if k.endswith(EXPERT_PARAMS)]
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if not k.endswith(("_blocks", "_scales")))
    assert "lm_head.weight" in sd and "model.layers.0.self_attn.sinks" in sd


def test_dequantized_load_matches_checkpoint_and_runs(tiny_dir, tmp_path):
    sd = load_file(tiny_dir / "model.safetensors")
    model = load_mxfp4_dequantized(tiny_dir)
    assert model.config._attn_implementation == "eager"  # gpt-oss has no sdpa
    assert "quantization_config" not in model.config.to_dict()  # plain 16-bit weights now
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(EXPERT_PARAMS):
            ref = dequantize_mxfp4(sd[name + "_blocks"], sd[name + "_scales"]).transpose(1, 2)
            assert p.dtype == torch.bfloat16 and torch.equal(p.data, ref), name
        else:
            assert torch.equal(p.data, sd[name].to(p.dtype)), name
    assert sum(n.endswith(EXPERT_PARAMS) for n in params) == 4
    assert {n for n in params if not n.endswith(EXPERT_PARAMS)} == {k for k in sd if not k.endswith(("_blocks", "_scales"))}

    ids = torch.tensor([[5, 17, 3, 42, 8, 1, 60], [9, 9, 2, 70, 33, 4, 0]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 7, VOCAB) and torch.isfinite(logits).all()

    # Re-encoding the dequantized model is lossless: the weights are already on the MXFP4 grid. (Small shards to
    # exercise the sharded layout with model.safetensors.index.json too.)
    save_mxfp4_checkpoint(model, tmp_path / "again", max_shard_size=20_000)
    assert len(list((tmp_path / "again").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "again" / "model.safetensors.index.json").exists()
    again = dict(load_mxfp4_dequantized(tmp_path / "again").named_parameters())
    assert all(torch.equal(again[n].data, p.data) for n, p in params.items())


def test_dequantized_copy_loads_unquantized_with_the_same_weights(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from lora_pipeline.families.gpt_oss import mxfp4_checkpoint

    src = tmp_path / "mxfp4"
    shutil.copytree(tiny_dir, src)
    (src / "tokenizer.json").write_text("{}")
    save_dequantized(src, tmp_path / "bf16", max_shard_size=20_000)  # sharded, as 42 GB of gpt-oss-20b is
    out = tmp_path / "bf16"
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    stored = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert not any(k.endswith(("_blocks", "_scales")) for k in stored)
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}
    assert (out / "tokenizer.json").read_text() == "{}"
    copy = dict(load_model(out, BF16, SimpleNamespace(method="none")).named_parameters())
    original = dict(load_mxfp4_dequantized(src).named_parameters())
    assert copy.keys() == original.keys()
    assert all(torch.equal(copy[n].data, p.data) for n, p in original.items())

    with pytest.raises(ValueError, match="bf16: not an MXFP4 checkpoint"):
        save_dequantized(out, tmp_path / "again")
    with pytest.raises(ValueError, match="bf16: exists and is not empty"):
        save_dequantized(src, out)
    assert not (tmp_path / "again").exists()

    def disk_full(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(mxfp4_checkpoint, "_write_shards", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_dequantized(src, tmp_path / "interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "mxfp4"]  # no partial copy, no staging folder


# bf16 is how the real model is loaded; its backward works on CPU (torch 2.13), so no upcast is needed to train.
# The float32 run (model upcast after loading) checks the merge tightly.
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-5)])
def test_lora_on_experts_trains_and_merges(tiny_dir, dtype, atol):
    from peft import LoraConfig, get_peft_model

    model = load_mxfp4_dequantized(tiny_dir).to(dtype)
    base_experts = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear",
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum("mlp.experts" in n for n in trainable) == 2 * 2 * 2  # 2 layers x 2 params x (A, B)
    assert any("self_attn.q_proj.lora_A" in n for n in trainable)

    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 16))
    with torch.no_grad():
        base_logits = peft_model(input_ids=ids).logits
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(4):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    peft_model.eval()
    with torch.no_grad():
        final = peft_model(input_ids=ids, labels=ids).loss.item()
        adapted = peft_model(input_ids=ids).logits
    assert all(b < a for a, b in zip(losses + [final], losses[1:] + [final])), losses + [final]
    assert final < losses[0] - 0.3, (losses, final)
    for n, p in peft_model.named_parameters():
        if "mlp.experts" in n and "lora_B" in n:
            assert p.abs().max() > 0, n  # the experts' adapters were trained

    merged = peft_model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert not torch.equal(merged.model.layers[0].mlp.experts.gate_up_proj, base_experts)
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    assert (adapted - base_logits).abs().max() > 20 * atol  # the adapter changed the output noticeably
    torch.testing.assert_close(merged_logits, adapted, atol=atol, rtol=0)


def test_min_error_scale_keeps_a_grown_groups_scale_and_never_does_worse():
    on_grid, _, _ = _representable((6, 256), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(on_grid, scale="min_error"), quantize_mxfp4(on_grid)))
    # An on-grid group at scale 2**0 (max 6) whose 6 grew to 6.02, as a merged LoRA does: round_up doubles its scale
    # and re-rounds all 32 values on the coarser grid (0.5 -> 0, 1.5 -> 2, ...); min_error keeps 2**0 and clips to 6.
    w = torch.tensor([6.02, 0.5, 1.5, -2.0, 3.0, -0.5] + [1.0] * 26)
    up, fit = (dequantize_mxfp4(*quantize_mxfp4(w, scale=s), torch.float32) for s in ("round_up", "min_error"))
    assert quantize_mxfp4(w)[1].item() == 128 and quantize_mxfp4(w, scale="min_error")[1].item() == 127
    assert fit.tolist() == [6.0, 0.5, 1.5, -2.0, 3.0, -0.5] + [1.0] * 26
    assert up.tolist()[:6] == [6.0, 0.0, 2.0, -2.0, 3.0, 0.0]
    assert (fit - w).square().sum() < (up - w).square().sum() / 100
    # Where both scales give the same values (all on the coarser grid too), min_error keeps the finer one.
    w = torch.tensor([6.02, 1.0, 2.0, -3.0, 4.0, 0.0] + [1.0] * 26)
    assert quantize_mxfp4(w)[1].item() == 128 and quantize_mxfp4(w, scale="min_error")[1].item() == 127
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w), torch.float32),
                       dequantize_mxfp4(*quantize_mxfp4(w, scale="min_error"), torch.float32))
    torch.manual_seed(6)
    w = torch.randn(512, 256) * torch.rand(512, 1) * 0.05
    err = {s: (dequantize_mxfp4(*quantize_mxfp4(w, scale=s), torch.float32) - w).square().view(512, 8, 32).sum(-1)
           for s in ("round_up", "min_error")}
    assert torch.all(err["min_error"] <= err["round_up"])  # per group: it takes the better of two candidates
    assert err["min_error"].sum() < err["round_up"].sum()
    with pytest.raises(ValueError, match="scale must be"):
        quantize_mxfp4(w, scale="down")


def test_save_format_resolves_against_the_base_checkpoint(tiny_dir, tmp_path):
    from transformers import AutoConfig

    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import is_mxfp4_checkpoint, merged_save_format

    AutoConfig.for_model("qwen2", num_hidden_layers=1).save_pretrained(tmp_path)
    assert is_mxfp4_checkpoint(tiny_dir) and not is_mxfp4_checkpoint(tmp_path)
    assert [merged_save_format(f, tiny_dir) for f in ("auto", "mxfp4", "model_dtype")] == ["mxfp4", "mxfp4",
                                                                                          "model_dtype"]
    assert merged_save_format("auto", tmp_path) == "model_dtype"
    with pytest.raises(ValueError, match=r"merge\.save_format: mxfp4, but the base model \(qwen2\) is not gpt-oss"):
        merged_save_format("mxfp4", tmp_path)


ATTENTION = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def _add_low_rank_deltas(model, relative: float, seed: int, rank: int = 4, targets=EXPERT_PARAMS + ATTENTION) -> None:
    """W += A @ B (rank 4, ||A @ B|| = relative * ||W||) on the experts and attention projections: what a LoRA
    on them (target_modules all-linear, target_parameters the experts) merges."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(targets):
                delta = torch.randn(*p.shape[:-1], rank, generator=g) @ torch.randn(*p.shape[:-2], rank, p.shape[-1],
                                                                                   generator=g)
                p += delta * (relative * p.norm() / delta.norm())


def _corrupted(src, dest, fix):
    """A copy of an MXFP4 checkpoint with fix(name, tensor) applied to every tensor: a broken encoder's output."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    save_file({k: fix(k, v) for k, v in tensors.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_merged_model_requantized_to_mxfp4(tiny_dir, tmp_path):
    """A merged model (base + LoRA-like deltas, float32) saved as MXFP4 is the base checkpoint's size, loads with
    Mxfp4Config(dequantize=True), and its logits stay closer to the 16-bit merged model's than MXFP4 itself put the
    base release from its bf16 original; a wrong nibble order or scale is far beyond that bound."""
    from lora_pipeline.merge.merged_checks import compare_logits
    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_values_changed, load_into
    from lora_pipeline.model.tiny import random_gpt_oss

    ids = torch.randint(2, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))

    def logits(model):
        with torch.no_grad():
            return model.float()(input_ids=ids).logits

    # The bound: the error of the base's own round trip, the bf16 model tiny_dir was written from vs tiny_dir.
    original = random_gpt_oss(vocab_size=VOCAB, seed=0, eos_token_id=1, pad_token_id=0)
    base_logits = logits(load_mxfp4_dequantized(tiny_dir))
    bound = compare_logits(logits(original), base_logits)["mean_abs_logit_diff"]

    merged = load_mxfp4_dequantized(tiny_dir).float()
    _add_low_rank_deltas(merged, relative=0.1, seed=1)
    merged_logits = logits(merged)
    save_mxfp4_checkpoint(merged, tmp_path / "mxfp4", scale="min_error")

    saved = load_mxfp4_dequantized(tmp_path / "mxfp4")  # Mxfp4Config(dequantize=True), as openai/gpt-oss-20b
    error = compare_logits(merged_logits, logits(saved))
    lora_effect = compare_logits(merged_logits, base_logits)["mean_abs_logit_diff"]
    changed = expert_values_changed(tmp_path / "mxfp4", tiny_dir)
    print(f"mean |logit diff| vs the 16-bit merged model: {error['mean_abs_logit_diff']:.4f} (top-1 agreement "
          f"{error['top1_agreement']:.3f}); bound (base's own MXFP4 round trip) {bound:.4f}; the merged deltas' own "
          f"effect {lora_effect:.4f}; expert values changed from the base {changed:.3f}")
    # Measured: 0.0073 against a bound of 0.0131 and an effect of 0.0170; 16 % of expert values changed.
    assert error["mean_abs_logit_diff"] < bound
    assert error["mean_abs_logit_diff"] < lora_effect  # the merged deltas are in the saved experts
    assert 0.05 < changed < 0.5

    # The bound catches a broken encoder: measured 0.087 (nibbles swapped), 0.106 / 0.050 (scales off by one).
    broken = {"nibbles_swapped": lambda k, t: (t >> 4) | (t << 4) if k.endswith("_blocks") else t,
              "scale_doubled": lambda k, t: t + 1 if k.endswith("_scales") else t,
              "scale_halved": lambda k, t: t - 1 if k.endswith("_scales") else t}
    for name, fix in broken.items():
        wrong = load_mxfp4_dequantized(_corrupted(tmp_path / "mxfp4", tmp_path / name, fix))
        assert compare_logits(merged_logits, logits(wrong))["mean_abs_logit_diff"] > 2 * bound, name

    # load_into (the merge stage's read-back) gives the model exactly as from_pretrained loads it.
    load_into(merged, tmp_path / "mxfp4")
    loaded = dict(load_mxfp4_dequantized(tmp_path / "mxfp4", dtype=torch.float32).named_parameters())
    assert all(torch.equal(p, loaded[n]) for n, p in merged.named_parameters())

    def size(folder):
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    merged.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # as merge.save_format model_dtype, in bf16
    assert size(tmp_path / "mxfp4") == size(tiny_dir)  # the base release's layout, key for key
    assert size(tmp_path / "mxfp4") < 0.5 * size(tmp_path / "bf16")
    assert json.loads((tmp_path / "mxfp4" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"


def test_lora_on_attention_only_leaves_the_experts_values_exactly(tiny_dir, tmp_path):
    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_values_changed

    merged = load_mxfp4_dequantized(tiny_dir)
    _add_low_rank_deltas(merged, relative=0.1, seed=2, targets=ATTENTION)
    save_mxfp4_checkpoint(merged, tmp_path, scale="min_error")
    # The same values (the bytes may differ: a group whose largest value rounded down to 3 * 2**e in the base is
    # written with the smaller scale that now fits it).
    assert expert_values_changed(tmp_path, tiny_dir) == 0.0
    base, saved = load_file(tiny_dir / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert base.keys() == saved.keys()
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"], saved["model.layers.0.self_attn.q_proj.weight"])
