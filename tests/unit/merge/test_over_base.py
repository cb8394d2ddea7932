"""merge's MXFP4 checkpoint written over the base's files (lora_pipeline.merge.over_base) for a tiny gpt-oss with a LoRA
on attention: it loads as the re-encoded checkpoint does, weight for weight; the experts are the base's bytes; a wrong
byte anywhere fails its check; a LoRA on the experts cannot take it. And the merge stage on it, phases logged."""
import json
import os
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open

from lora_pipeline.config.outputs import write_jsonl
from lora_pipeline.merge.merged_checks import check_merged_weights, lora_weights
from lora_pipeline.merge.over_base import (changed_weights, copy_problem, put_stored, save_over_base,
                                           verify_over_base)
from lora_pipeline.model.loading import load_model
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint
from lora_pipeline.model.checkpoint_files import tensor_files
from lora_pipeline.model.tiny import random_gpt_oss, tokenizer_corpus, train_tokenizer

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def model_params(dtype: str):
    return SimpleNamespace(dtype=dtype, attn_implementation="eager", experts_implementation="eager",
                           trust_remote_code=False)


def tiny_base(out, rows, max_shard_size=5 * 2**30):
    """A tiny gpt-oss with its tokenizer (harmony template), stored as openai/gpt-oss is: experts MXFP4, the rest
    bf16."""
    tokenizer = train_tokenizer(tokenizer_corpus(rows), 400, "tiny-gpt-oss", out)
    model = random_gpt_oss(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=0)
    save_mxfp4_checkpoint(model, out, max_shard_size=max_shard_size)
    return out


@pytest.fixture(scope="module")
def rows():
    from lora_pipeline.data.builtin import generate

    return generate(24, seed=0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, rows):
    """Sharded, as openai/gpt-oss-20b is: several files and an index."""
    out = tiny_base(tmp_path_factory.mktemp("sharded") / "base", rows, max_shard_size=100_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    return out


def make_adapter(base_dir, out, biases=False, **targets):
    """A LoRA over the base with random B matrices, saved as the train stage saves one; with `biases` (lora.bias all)
    the biases peft trains (`.bias`: attention, routers) moved by a random amount."""
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, bias="all" if biases else "none",
                        **targets)
    model = get_peft_model(load_model(base_dir, model_params("bfloat16")), config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or (biases and name.endswith(".bias")):
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.02)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def attention_adapter(base_dir):
    return make_adapter(base_dir, base_dir.parent / "attention", target_modules=ATTENTION)


def merge(base_dir, adapter_dir, dtype="bfloat16"):
    model = PeftModel.from_pretrained(load_model(base_dir, model_params(dtype)), adapter_dir).eval()
    layers = lora_weights(model)
    with torch.no_grad():
        merged = model.merge_and_unload()
    assert check_merged_weights(merged, layers, base_dir, adapter_dir).problem is None
    return merged, changed_weights(merged, layers, adapter_dir)


def stored_tensors(folder) -> dict:
    files = tensor_files(folder)
    out = {}
    for name, path in files.items():
        with safe_open(path, "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_written_over_the_base_it_loads_as_the_reencoded_checkpoint(base_dir, attention_adapter, tmp_path):
    merged, changed = merge(base_dir, attention_adapter)
    assert sorted(changed) == sorted(f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ATTENTION)
    assert copy_problem(changed, base_dir) is None
    save_over_base(base_dir, tmp_path / "over", changed)
    written = verify_over_base(base_dir, tmp_path / "over", changed)
    base, over = stored_tensors(base_dir), stored_tensors(tmp_path / "over")
    assert written.replaced == 8 and written.copied == len(base) - 8 and written.rounded == []
    assert over.keys() == base.keys()
    for name, tensor in over.items():  # the adapted weights are the merged values, every other tensor the base's
        expected = changed[name] if name in changed else base[name]
        assert tensor.dtype == base[name].dtype and torch.equal(tensor, expected), name
    assert any(not torch.equal(over[name], base[name]) for name in changed)
    for fname in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert (tmp_path / "over" / fname).read_bytes() == (base_dir / fname).read_bytes(), fname
    assert json.loads((tmp_path / "over/config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"

    # Loaded as every stage loads it (experts decoded), it is the re-encoded checkpoint's model and the merged one.
    save_mxfp4_checkpoint(merged, tmp_path / "reencoded", scale="min_error")
    reencoded = load_model(tmp_path / "reencoded", model_params("bfloat16")).state_dict()
    loaded = load_model(tmp_path / "over", model_params("bfloat16")).state_dict()
    in_memory = merged.state_dict()
    assert loaded.keys() == reencoded.keys() == in_memory.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reencoded[name]) and torch.equal(tensor, in_memory[name]), name


def test_a_float32_merge_is_rounded_once_to_the_stored_bf16_and_put_back_as_saved(base_dir, attention_adapter,
                                                                                   tmp_path):
    merged, changed = merge(base_dir, attention_adapter, "float32")
    save_over_base(base_dir, tmp_path, changed)
    written = verify_over_base(base_dir, tmp_path, changed)
    assert sorted(written.rounded) == sorted(changed)  # float32 merged values, stored bf16 as the base's
    assert stored_tensors(tmp_path)[written.rounded[0]].dtype == torch.bfloat16
    put_stored(changed, tmp_path, written.rounded)
    loaded = load_model(tmp_path, model_params("float32")).state_dict()
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in merged.state_dict().items())


def test_trained_biases_are_written_over_the_base_too(base_dir, tmp_path):
    adapter = make_adapter(base_dir, tmp_path / "adapter", biases=True, target_modules=ATTENTION)
    merged, changed = merge(base_dir, adapter)
    biases = [name for name in changed if name.endswith("bias")]
    assert {"model.layers.0.mlp.router.bias", "model.layers.1.self_attn.o_proj.bias"} <= set(biases)
    save_over_base(base_dir, tmp_path / "over", changed)
    assert verify_over_base(base_dir, tmp_path / "over", changed).replaced == len(changed)
    loaded = load_model(tmp_path / "over", model_params("bfloat16")).state_dict()
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in merged.state_dict().items())


def test_a_lora_on_the_experts_cannot_be_written_over_the_base(base_dir, tmp_path):
    adapter = make_adapter(base_dir, tmp_path / "adapter", target_modules=ATTENTION, target_parameters=EXPERT_PARAMS)
    merged, changed = merge(base_dir, adapter)
    assert "model.layers.0.mlp.experts.gate_up_proj" in changed
    problem = copy_problem(changed, base_dir)
    assert problem and "mlp.experts" in problem and "MXFP4" in problem
    with pytest.raises(ValueError, match="MXFP4"):
        save_over_base(base_dir, tmp_path / "over", changed)
    assert not (tmp_path / "over").exists()


def test_a_wrong_byte_anywhere_fails_the_check_naming_it(base_dir, attention_adapter, tmp_path):
    merged, changed = merge(base_dir, attention_adapter)
    save_over_base(base_dir, tmp_path, changed)
    files = tensor_files(tmp_path)
    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    with safe_open(files[blocks], "pt") as f:
        value = f.get_tensor(blocks)
    path = files[blocks]
    data = path.read_bytes()
    at = data.index(value.reshape(-1).numpy().tobytes()) + 100  # a byte of that tensor's data
    path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    with pytest.raises(ValueError, match=f"{blocks}\\) is not the base's"):
        verify_over_base(base_dir, tmp_path, changed)
    path.write_bytes(data)
    verify_over_base(base_dir, tmp_path, changed)

    other = dict(changed)  # a merged weight other than the one written
    name = "model.layers.0.self_attn.k_proj.weight"
    other[name] = changed[name] + 1
    with pytest.raises(ValueError, match=f"{name} read back is not the merged model's"):
        verify_over_base(base_dir, tmp_path, other)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": None}))
    with pytest.raises(ValueError, match="not the base's config.json"):
        verify_over_base(base_dir, tmp_path, changed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_stage_writes_over_the_base_and_logs_its_phases(dtype, rows, tmp_path, monkeypatch):
    """The merge stage on a single-file base: the experts the base's bytes, verified; in bf16 the saved model is the
    merged one, no forward needed; in float32 the attention weights are rounded to the stored bf16 and the logits of
    the model as saved computed."""
    with patch.dict(os.environ):  # importing the stages pins the CPU numerics in os.environ
        from stages import merge as stage
    base = tiny_base(tmp_path / "models/base", rows)
    make_adapter(base, tmp_path / "models/adapter", target_modules="all-linear")
    write_jsonl(rows[:4], tmp_path / "data/split/test.jsonl")
    params = SimpleNamespace(model=model_params(dtype), merge=SimpleNamespace(save_format="auto"),
                             quantization=SimpleNamespace(method="none"))
    monkeypatch.setattr(stage, "load_params", lambda name: params)
    monkeypatch.chdir(tmp_path)
    stage.main()

    metrics = json.loads((tmp_path / "metrics/merge.json").read_text())
    speed = json.loads((tmp_path / "logs/merge_speed.json").read_text())
    assert speed["written_as"] == "over_base" and speed["save_format"] == "mxfp4"
    assert set(speed["phase_seconds"]) == {"tokenizer", "load_base", "load_adapter", "logits", "merge_and_unload",
                                           "weight_check", "save", "read_back_check"}
    figures = metrics["mxfp4"]
    assert figures["expert_values_changed"] == 0 and figures["tensors_replaced"] == 8
    assert metrics["weights"]["adapted"] == 8 and metrics["weights"]["max_error_over_bound"] <= 1
    assert figures["saved_logits_computed"] == (dtype == "float32")
    if dtype == "bfloat16":
        assert figures["max_abs_logit_diff"] == 0 and figures["top1_agreement"] == 1
    else:
        assert 0 < figures["mean_relative_logit_diff"] < 0.01, figures
    merged = tmp_path / "models/merged"
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= {f.name for f in merged.iterdir()}
    base_tensors, saved = stored_tensors(base), stored_tensors(merged)
    experts = [name for name in base_tensors if "mlp.experts" in name and name.endswith(("_blocks", "_scales"))]
    assert experts and all(torch.equal(saved[name], base_tensors[name]) for name in experts)
