"""params.yaml validation, the per-stage views of it, and the stop when it changes during a run."""
import subprocess
import sys

import pytest
import yaml
from dvc.utils.serialize import parse_yaml

from conftest import ROOT, copy_repo, run_env, set_params
from lora_pipeline.config.dvcfiles import declared_params
from lora_pipeline.config.outputs import write_jsonl
from lora_pipeline.config.params import Params, ParamsError, for_stage, load_params, params_digest, validate
from lora_pipeline.data.builtin import generate
from lora_pipeline.validation.all_checks import check_library_fields

STAGES = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_validate():
    params = validate(shipped())
    assert params.model.source == "tiny-qwen2" and params.data.source == "builtin"


@pytest.mark.parametrize("stage", STAGES)
def test_every_declared_key_exists(stage):
    assert isinstance(load_params(stage), Params)
    assert declared_params(stage), f"stage {stage} declares no params"


@pytest.mark.parametrize("key, value, fragment", [
    ("lora.r", 0, "lora.r"),
    ("lora.lora_dropout", 1.5, "lora.lora_dropout"),
    ("train.sft.learning_rate", "fast", "train.sft.learning_rate"),
    ("train.accelerate_config", "nope", "configs/accelerate/nope.yaml"),
    ("model.source", "gpt-5", "model.source"),
    ("split.test_size", 0, "split.test_size"),
    ("data.bad_rows", "skip", "data.bad_rows"),
    ("data.max_chars", -1, "data.max_chars"),
    ("model.tiny.pretrain_steps", 1, "model.tiny: Value error, pretrain_steps 1 leaves the one-cycle schedule no step"),
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
    view = for_stage(validate(raw), "validate", ["train", "lora"])
    with pytest.raises(ValueError, match=message):
        check_library_fields(view.train, view.lora)


def test_any_real_library_field_passes_through():
    raw = shipped()
    raw["lora"]["use_rslora"] = True
    raw["train"]["sft"]["max_grad_norm"] = 0.5
    view = for_stage(validate(raw), "train", ["train", "lora"])
    check_library_fields(view.train, view.lora)
    assert view.lora.dump()["use_rslora"] is True and view.train.sft.dump()["max_grad_norm"] == 0.5


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
    assert train.train.sft.dump()["learning_rate"] == shipped()["train"]["sft"]["learning_rate"]
    with pytest.raises(ParamsError, match=r"stage 'train' reads 'eval', which dvc.yaml does not list"):
        train.eval.prompts
    with pytest.raises(ParamsError, match=r"stage 'train' reads 'model\.name'"):  # model.dtype is declared
        train.model.name
    assert train.model.dtype == shipped()["model"]["dtype"]
    split = load_params("split")
    with pytest.raises(ParamsError, match=r"stage 'split' reads 'lora'"):
        split.lora.r


@pytest.mark.parametrize("stage, section", [("evaluate_base", "eval"), ("evaluate", "eval"), ("register", "register")])
def test_a_stage_that_reads_a_whole_section_declares_it_whole(stage, section):
    assert section in declared_params(stage)
    assert getattr(load_params(stage), section).dump() == shipped()[section]


def test_dump_needs_every_leaf_declared(tmp_path):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    dvc["stages"]["train"]["params"] = [k for k in dvc["stages"]["train"]["params"] if k != "train"] + [
        "train.accelerate_config", "train.liger", "train.checkpoint_steps", "train.sft.learning_rate"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    with pytest.raises(ParamsError, match=r"train\.sft\.num_train_epochs"):
        load_params("train", root=tmp_path).train.sft.dump()


def run_stage(repo, name):
    """A stage's command as DVC runs it: DVC sets DVC_STAGE for each."""
    return subprocess.run([sys.executable, "-m", f"stages.{name}"], cwd=repo, env=run_env(DVC_STAGE=name),
                          capture_output=True, text=True)


def files(repo) -> dict:
    return {p: p.read_bytes() for p in repo.rglob("*")
            if p.is_file() and not {".git", "__pycache__"} & set(p.relative_to(repo).parts)}


@pytest.mark.e2e  # the stages as subprocesses
def test_stage_stops_when_params_changed_after_validate_checked_them(tmp_path, monkeypatch):
    """A second `dvc exp run -S` writes params.yaml before DVC's lock stops it (or params.yaml is edited) while a
    run goes: that run's next stage stops with one line before any work. An edit that validate checked runs, and so
    does params.yaml back at what dvc.lock records (`dvc exp apply`, `git checkout params.yaml dvc.lock`)."""
    repo = copy_repo(tmp_path / "repo")
    shipped_text = (repo / "params.yaml").read_text()
    lock = {"schema": "2.0", "stages": {"validate": {"params": {"params.yaml": yaml.safe_load(shipped_text)}}}}
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock))  # validate last ran on the shipped params
    write_jsonl(generate(40, seed=0), repo / "data/raw/data.jsonl")  # what fetch writes
    assert run_stage(repo, "validate").returncode == 0  # the run starts: validate checks params.yaml
    set_params(repo, **{"split.seed": 7})  # another experiment's -S lands in params.yaml
    before = files(repo)
    proc = run_stage(repo, "split")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        "split: params.yaml changed after validate checked it at the start of this run (another `dvc exp run`, or "
        "an edit, during the run)"), proc.stderr
    assert "`dvc exp run --queue` then `dvc exp run --run-all`" in proc.stderr
    assert files(repo) == before  # nothing written
    # the same edit made before a run: validate (which every params change re-runs) checks it first
    assert run_stage(repo, "validate").returncode == 0
    proc = run_stage(repo, "split")
    assert proc.returncode == 0, proc.stderr
    assert (repo / "data/split/train.jsonl").is_file()
    # back at the values dvc.lock records for validate, which is up to date and does not run: nothing stops
    (repo / "params.yaml").write_text(shipped_text.replace("# Every knob", "# Each knob"))  # comments do not count
    monkeypatch.setenv("DVC_STAGE", "split")
    assert load_params("split", root=repo).split.seed == yaml.safe_load(shipped_text)["split"]["seed"]
    set_params(repo, **{"split.seed": 8})  # neither what validate checked nor what dvc.lock records
    with pytest.raises(SystemExit, match=r"^split: params\.yaml changed after validate"):
        load_params("split", root=repo)
    # not run by DVC (a stage run by hand, a launcher on another node): nothing to compare with
    monkeypatch.delenv("DVC_STAGE")
    assert load_params("split", root=repo).split.seed == 8


def test_params_digest_counts_values_as_dvc_reads_them():
    """Comments, layout and the spelling of a number do not change the digest (DVC's YAML reads 1e-8 as a float,
    and dvc.lock records it as 1.0e-08); a value does."""
    text = (ROOT / "params.yaml").read_text()
    assert "learning_rate: 0.005" in text and "lora_dropout: 0.05" in text
    extra = text.replace("    learning_rate: 0.005", "    learning_rate: 0.005\n    adam_epsilon: 1.0e-08")
    respelt = text.replace("    learning_rate: 0.005", "    learning_rate: 5e-3   # respelt\n    adam_epsilon: 1e-8")
    def digest(text):
        return params_digest(parse_yaml(text, "params.yaml"))

    assert digest(respelt) == digest(extra) != digest(text)
    assert digest(text.replace("lora_dropout: 0.05", "lora_dropout: 0.1")) != digest(text)


def test_validate_caches_what_it_derives_from_the_libraries(tmp_path, monkeypatch):
    """The library field names and the base model's module names are cached per library version and config, and
    the cached values are the ones a fresh import and a fresh build give."""
    import dataclasses

    from peft import LoraConfig
    from transformers import SchedulerType

    from lora_pipeline.model.base_checks import base_model_layout
    from lora_pipeline.validation.all_checks import library_fields

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fields = library_fields()
    assert set(fields["peft.LoraConfig"]) == {f.name for f in dataclasses.fields(LoraConfig)}
    assert fields["transformers.SchedulerType"] == [s.value for s in SchedulerType]
    model = for_stage(validate(shipped()), "validate", ["model"]).model
    built = base_model_layout(model, ROOT)
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "lora-pipeline").glob("*.json"))
    assert cached == ["fields", "layout"], cached
    assert library_fields() == fields and base_model_layout(model, ROOT) == built
    assert any(name.endswith("self_attn.q_proj") for name in built.modules)
    raw = shipped()
    raw["model"]["tiny"]["num_hidden_layers"] = 1
    other = validate(raw)
    one_layer = base_model_layout(for_stage(other, "validate", ["model"]).model, ROOT)
    assert len(list((tmp_path / "lora-pipeline").glob("layout-*.json"))) == 2  # another config, another entry
    assert not any(".layers.1." in name for name in one_layer.modules)
