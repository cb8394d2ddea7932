"""params.yaml validation and the per-stage views of it."""
import pytest
import yaml

from conftest import ROOT
from lora_pipeline.checks import check_library_fields
from lora_pipeline.params import ParamsError, StageParams, declared_keys, load_params, validate

STAGES = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_validate():
    params = validate(shipped())
    assert params.model.source == "tiny-qwen2" and params.data.source == "builtin"


@pytest.mark.parametrize("stage", STAGES)
def test_every_declared_key_exists(stage):
    assert isinstance(load_params(stage), StageParams)
    assert declared_keys(stage), f"stage {stage} declares no params"


@pytest.mark.parametrize("key, value, fragment", [
    ("lora.r", 0, "lora.r"),
    ("lora.lora_dropout", 1.5, "lora.lora_dropout"),
    ("train.sft.learning_rate", "fast", "train.sft.learning_rate"),
    ("train.accelerate_config", "nope", "configs/accelerate/nope.yaml"),
    ("model.source", "gpt-5", "model.source"),
    ("split.test_size", 0, "split.test_size"),
    ("data.bad_rows", "skip", "data.bad_rows"),
    ("data.max_chars", -1, "data.max_chars"),
])
def test_bad_value_names_the_key(key, value, fragment):
    raw = shipped()
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ParamsError, match=fragment.replace(".", r"\.")):
        validate(raw)


def test_lora_on_parameters_needs_no_dropout():
    raw = shipped()
    raw["lora"]["target_parameters"] = ["mlp.experts.gate_up_proj"]
    raw["lora"]["lora_dropout"] = 0.05
    with pytest.raises(ParamsError, match="needs lora_dropout 0"):
        validate(raw)
    raw["lora"]["lora_dropout"] = 0.0
    assert validate(raw).lora.target_parameters == ["mlp.experts.gate_up_proj"]


@pytest.mark.parametrize("section, key, message", [
    ("lora", "rank", r"lora\.rank: not a peft\.LoraConfig field; did you mean lora\.r\?"),
    ("sft", "learning_rat", r"train\.sft\.learning_rat: not a trl\.SFTConfig field.*did you mean train\.sft\.learning_rate\?"),
    ("sft", "output_dir", r"train\.sft\.output_dir: the train stage sets it itself"),
])
def test_misspelt_library_field_is_rejected_with_the_closest_name(section, key, message):
    raw = shipped()
    (raw["lora"] if section == "lora" else raw["train"]["sft"])[key] = 16  # a typo must not be silently ignored
    view = StageParams(validate(raw), "validate", ["train", "lora"])
    with pytest.raises(ValueError, match=message):
        check_library_fields(view.train, view.lora)


def test_any_real_library_field_passes_through():
    raw = shipped()
    raw["lora"]["use_rslora"] = True
    raw["train"]["sft"]["max_grad_norm"] = 0.5
    view = StageParams(validate(raw), "train", ["train", "lora"])
    check_library_fields(view.train, view.lora)
    assert view.lora.to_dict()["use_rslora"] is True and view.train.sft.to_dict()["max_grad_norm"] == 0.5


def test_missing_key_is_rejected():
    raw = shipped()
    del raw["lora"]["r"]  # the schema holds no second default that would hide it
    with pytest.raises(ParamsError, match=r"lora\.r: Field required"):
        validate(raw)


@pytest.mark.parametrize("key", ["bad_rows", "max_chars"])
def test_data_keys_without_a_default_are_required(key):
    raw = shipped()
    del raw["data"][key]
    with pytest.raises(ParamsError, match=rf"data\.{key}: Field required"):
        validate(raw)


def test_hub_source_needs_a_name():
    raw = shipped()
    raw["data"]["source"] = "hub"
    with pytest.raises(ParamsError, match="name is required"):
        validate(raw)


def test_stage_view_refuses_undeclared_keys():
    train = load_params("train")
    assert train.lora.r == shipped()["lora"]["r"]
    assert train.train.sft.to_dict()["learning_rate"] == shipped()["train"]["sft"]["learning_rate"]
    with pytest.raises(ParamsError, match=r"stage 'train' reads 'eval', which dvc.yaml does not list"):
        train.eval.prompts
    with pytest.raises(ParamsError, match=r"stage 'train' reads 'model\.name'"):  # model.dtype is declared
        train.model.name
    assert train.model.dtype == shipped()["model"]["dtype"]
    split = load_params("split")
    with pytest.raises(ParamsError, match=r"stage 'split' reads 'lora'"):
        split.lora.r


def test_to_dict_needs_every_leaf_declared(tmp_path):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    dvc["stages"]["train"]["params"] = [k for k in dvc["stages"]["train"]["params"] if k != "train"] + [
        "train.accelerate_config", "train.liger", "train.checkpoint_steps", "train.sft.learning_rate"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    with pytest.raises(ParamsError, match=r"train\.sft\.num_train_epochs"):
        load_params("train", root=tmp_path).train.sft.to_dict()
