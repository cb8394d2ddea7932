"""quantization params: the one loader's choices (as stored, MXFP4 dequantized, nf4/int8 through bitsandbytes), QLoRA
training on the CPU, and `dvc exp run -S quantization.method=nf4` through the real pipeline."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import edited_params, run
from helpers import build_tiny_gpt_oss
from lora_pipeline.model.loading import load_model

FP32 = SimpleNamespace(dtype="float32", attn_implementation="sdpa", experts_implementation="eager",
                       trust_remote_code=False)
BF16 = SimpleNamespace(dtype="bfloat16", attn_implementation="sdpa", experts_implementation="eager",
                       trust_remote_code=False)


def quantization(method, compute_dtype="auto", double_quant=True):
    return SimpleNamespace(method=method, compute_dtype=compute_dtype, double_quant=double_quant)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A plain (full-precision) Qwen2 checkpoint, as the tiny default and a merged model are stored."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """A gpt-oss checkpoint with its experts in MXFP4, its config.json declaring so (as openai/gpt-oss-20b's)."""
    out = tmp_path_factory.mktemp("gpt_oss")
    build_tiny_gpt_oss(out, vocab_size=96, seed=0, eos_token_id=1, pad_token_id=0)
    return out


def layer_kinds(model) -> dict[str, int]:
    kinds = {}
    for module in model.modules():
        if not list(module.children()):
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
    return kinds


def test_none_loads_the_checkpoint_as_stored(qwen2_dir):
    model = load_model(qwen2_dir, FP32, quantization("none"))
    assert layer_kinds(model)["Linear"] == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert model.dtype == torch.float32 and "quantization_config" not in model.config.to_dict()
    plain = load_model(qwen2_dir, FP32)  # a merged model: full precision whatever was trained
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize("compute, expected", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_nf4_freezes_the_linear_layers_in_4_bits(qwen2_dir, compute, expected):
    model = load_model(qwen2_dir, FP32, quantization("nf4", compute, double_quant=False))
    kinds = layer_kinds(model)
    assert kinds["Linear4bit"] == 2 * 7 and kinds["Linear"] == 1  # lm_head (tied to the embeddings) stays
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == torch.uint8 and layer.weight.quant_state.quant_type == "nf4"
    assert layer.compute_dtype == expected
    assert layer.weight.quant_state.state2 is None  # double_quant false: the constants are not quantized again
    assert load_model(qwen2_dir, FP32, quantization("nf4")).model.layers[0].self_attn.q_proj.weight.quant_state.state2


def test_int8_freezes_the_linear_layers_in_8_bits(qwen2_dir):
    model = load_model(qwen2_dir, FP32, quantization("int8"))
    assert layer_kinds(model)["Linear8bitLt"] == 2 * 7
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_qlora_trains_on_the_cpu(qwen2_dir, method):
    """The base frozen in 4/8 bits, LoRA on top (peft's prepare_model_for_kbit_training): the loss falls and only
    the adapters get gradients."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(load_model(qwen2_dir, FP32, quantization(method)),
                                            use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert {n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}


def test_mxfp4_checkpoint_loads_dequantized_and_nothing_else(gpt_oss_dir):
    for model in (load_model(gpt_oss_dir, BF16, quantization("mxfp4-dequantize")), load_model(gpt_oss_dir, BF16)):
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.ndim == 3
        assert "quantization_config" not in model.config.to_dict()  # plain 16-bit weights: saved as such
    for method in ("none", "nf4", "int8"):
        with pytest.raises(ValueError, match=rf"quantization\.method: {method}, but the base model stores MXFP4"):
            load_model(gpt_oss_dir, BF16, quantization(method))


def test_mxfp4_dequantize_on_a_plain_checkpoint_is_refused(qwen2_dir):
    with pytest.raises(ValueError, match=r"quantization\.method: mxfp4-dequantize, but the base model has no MXFP4"):
        load_model(qwen2_dir, FP32, quantization("mxfp4-dequantize"))


def ran_stages(output: str) -> list[str]:
    import re

    return re.findall(r"Running stage '([\w-]+)'", output)


def changed_sections(changes: list) -> set[str]:
    """The params.yaml sections whose keys a stage's `dvc status --json` entry lists as changed: DVC lists a whole
    declared section under "changed deps", a single key under "changed params"."""
    return {key.split(".")[0] for change in changes if isinstance(change, dict)
            for key in change.get("changed params", change.get("changed deps", {})).get("params.yaml", {})}


def test_nf4_experiment_trains_on_a_4_bit_base_and_registers(repo):
    """`-S quantization.method=nf4` touches train, merge, the evaluations and register only, and registers a model."""
    import mlflow

    repo, _ = repo
    with edited_params(repo, **{"quantization.method": "nf4"}):
        status = json.loads(run(["dvc", "status", "--json"], repo))
    # The stages whose own params include quantization (earlier tests may leave others changed for other keys, as
    # evaluate for eval.prompts)
    touched = sorted(stage for stage, changes in status.items() if "quantization" in changed_sections(changes))
    assert touched == ["evaluate_base", "merge", "register", "train", "validate"], status
    assert "fetch" not in status and "split" not in status, status
    before = load_file(repo / "models/adapter/adapter_model.safetensors")
    registered = json.loads((repo / "models/registered.json").read_text())

    # Fewer steps and prompts: evaluate and train re-run for quantization alone, as the status above shows.
    output = run(["dvc", "exp", "run", "-n", "nf4", "-S", "quantization.method=nf4", "-S", "train.sft.max_steps=6",
                  "-S", "eval.prompts=1", "-S", "eval.max_new_tokens=32", "-S", "eval.mgsm.limit=1"], repo)
    assert ran_stages(output) == ["validate", "train", "merge", "evaluate_base", "evaluate", "register"]
    info = json.loads((repo / "models/adapter/training_info.json").read_text())["implementations"]
    assert info["quantization"] == "nf4" and info["quantized_layers"] == 2 * 7
    after = load_file(repo / "models/adapter/adapter_model.safetensors")
    assert after.keys() == before.keys()
    assert all(torch.isfinite(t.float()).all() for t in after.values())
    assert any(not torch.equal(after[k].float(), before[k].float()) for k in after if "lora_B" in k)
    merge = json.loads((repo / "metrics/merge.json").read_text())
    assert merge["relative_logit_diff"] < 1e-4  # merged into the full-precision base: the same model
    assert 0 < merge["trained_relative_logit_diff"] < 1  # the 4-bit base it was trained on differs a little
    merged = json.loads((repo / "models/merged/config.json").read_text())
    assert "quantization_config" not in merged and merged["dtype"] == "float32"
    ev = json.loads((repo / "metrics/eval.json").read_text())
    assert math.isfinite(ev["test"]["loss"]) and math.isfinite(ev["base"]["test"]["loss"])

    now = json.loads((repo / "models/registered.json").read_text())
    assert now["version"] == registered["version"] + 1 and "candidate" in now["aliases"]
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    version = mlflow.MlflowClient().get_model_version("lora-pipeline", str(now["version"]))
    assert "Quantization: compute_dtype=auto, double_quant=True, method=nf4" in version.description
