"""The whole pipeline on a tiny gpt-oss stored in MXFP4, loaded as openai/gpt-oss-20b is: Mxfp4Config(dequantize=True)."""
import json

import pytest
from safetensors import safe_open

from conftest import copy_repo, run, set_params

pytestmark = pytest.mark.e2e  # every test here runs the pipeline, DVC or an MLflow server


# A pipeline of its own, the longest after the default's: it runs in short_runs' group, after them, on the worker that
# is not building the default pipeline.
@pytest.mark.xdist_group("short_runs")
def test_tiny_mxfp4_gpt_oss_runs_the_whole_pipeline(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    set_params(repo, **{
        "model.source": "tiny-gpt-oss", "quantization.method": "mxfp4-dequantize",
        "model.attn_implementation": "eager", "model.tiny.pretrain_steps": 80, "data.builtin_rows": 800,
        "lora.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "lora.lora_dropout": 0.0,
        "train.sft.max_steps": 40, "eval.prompts": 2, "eval.max_new_tokens": 96,
        "register.model_name": "tiny-gpt-oss"})
    output = run(["dvc", "repro"], repo)
    assert "Running stage 'register'" in output

    base_config = json.loads((repo / "models/base/config.json").read_text())
    assert base_config["model_type"] == "gpt_oss"
    assert base_config["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(repo / "models/base/model.safetensors", "pt") as f:
        keys = list(f.keys())
        blocks = [k for k in keys if k.endswith("mlp.experts.gate_up_proj_blocks")]
        assert blocks and str(f.get_tensor(blocks[0]).dtype) == "torch.uint8"
        assert not any(k.endswith("mlp.experts.gate_up_proj") for k in keys)

    adapter = json.loads((repo / "models/adapter/adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert any(m.endswith("self_attn.q_proj") for m in adapter["target_modules"])  # all-linear: attention
    # merge.save_format auto: the merged model is stored as the base is, experts in MXFP4 (LoRA deltas included)
    merged_config = json.loads((repo / "models/merged/config.json").read_text())
    assert merged_config["quantization_config"] == base_config["quantization_config"]
    assert (repo / "models/merged/model.safetensors").stat().st_size == \
        (repo / "models/base/model.safetensors").stat().st_size
    merge = json.loads((repo / "metrics/merge.json").read_text())
    assert merge["relative_logit_diff"] < 1e-4
    # each layer's q, k, v, o and both expert weights checked against base + delta in bf16
    assert merge["weights"]["adapted"] == 6 * base_config["num_hidden_layers"], merge
    assert merge["weights"]["max_error_over_bound"] <= 1 and merge["weights"]["delta_above_rounding"] > 0, merge
    assert merge["mxfp4"]["expert_values_changed"] > 0.01, merge  # the trained experts' deltas survive re-encoding
    assert merge["mxfp4"]["top1_agreement"] > 0.8, merge

    ev = json.loads((repo / "metrics/eval.json").read_text())
    assert ev["test"]["loss"] < 0.7 * ev["base"]["test"]["loss"], ev
    assert "<|channel|>analysis<|message|>" in (repo / "reports/demo.txt").read_text()  # harmony format
    registered = json.loads((repo / "models/registered.json").read_text())
    assert registered["model_name"] == "tiny-gpt-oss" and "champion" in registered["aliases"]
