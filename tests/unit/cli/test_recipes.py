"""Recipes are short override files: they compose onto params.yaml, validate, and DVC applies them as written."""
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT, git_env, run
from cli.recipes import compose, exp_run_command, main
from lora_pipeline.config.params import ParamsError, flat_keys, for_stage, validate
from lora_pipeline.validation.all_checks import check_library_fields, check_scheduler

RECIPES = sorted(str(p.relative_to(ROOT / "recipes"))[:-5] for p in (ROOT / "recipes").rglob("*.yaml"))


def test_the_shipped_recipes_are_found():
    assert RECIPES == ["gpt-oss-20b", "qwen2-0.5b", "seed/gpt-oss-20b", "seed/qwen2-0.5b"]


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_composes_into_valid_params(name):
    params = for_stage(validate(compose(name), source=name), "recipe", ["model", "train", "lora"])
    check_library_fields(params.train, params.lora)
    check_scheduler(params.train)
    assert params.model.source == "hub"


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_holds_only_what_differs(name):
    raw = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    parent = raw.pop("extends", None)
    before = flat_keys(compose(parent)) if parent else flat_keys(yaml.safe_load((ROOT / "params.yaml").read_text()))
    same = {key: value for key, value in raw.items() if before.get(key, object()) == value}
    assert not same, f"recipes/{name}.yaml repeats values it inherits: {same}"
    assert len(raw) <= 40


def test_the_seed_recipes_change_only_training_speed_settings():
    for arch in ("qwen2-0.5b", "gpt-oss-20b"):
        fast, seed = flat_keys(compose(arch)), flat_keys(compose(f"seed/{arch}"))
        changed = {key for key in fast if fast[key] != seed[key]}
        assert changed and all(key.startswith(("model.dtype", "model.attn", "model.experts", "train.")) for key in changed)


def test_the_seed_recipes_turn_the_speed_levers_back_to_the_defaults():
    """Levers the fast recipes add (compiled layers, padded packed rows, how block masks are built, host syncs)
    stay at params.yaml's values in the seeds' exact settings."""
    default = flat_keys(yaml.safe_load((ROOT / "params.yaml").read_text()))
    for arch in ("qwen2-0.5b", "gpt-oss-20b"):
        seed = flat_keys(compose(f"seed/{arch}"))
        for key in ("train.compile_layers", "train.flex_block_mask", "train.sft.pad_to_multiple_of",
                    "train.host_syncs", "train.sft.dataloader_num_workers", "train.experts_kept_16bit"):
            assert seed.get(key) == default.get(key), (arch, key, seed.get(key))


@pytest.fixture
def recipes_root(tmp_path):
    (tmp_path / "recipes").mkdir()
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def write(root, name, text):
    (root / "recipes" / f"{name}.yaml").write_text(text)


def test_bad_recipes_are_named_with_the_key(recipes_root):
    write(recipes_root, "typo", "lora.rank: 16\n")
    write(recipes_root, "section", "lora:\n  r: 16\n")
    write(recipes_root, "a", "extends: b\nlora.r: 4\n")
    write(recipes_root, "b", "extends: a\n")
    write(recipes_root, "extra", "train.sft.max_grad_norm: 0.5\nmodel.tiny.hidden_size: 64\n")
    typo = for_stage(validate(compose("typo", recipes_root)), "recipe", ["train", "lora"])
    with pytest.raises(ValueError, match="lora.rank.*did you mean lora.r"):  # what `make recipe` checks first
        check_library_fields(typo.train, typo.lora)
    with pytest.raises(ParamsError, match="recipes/section.yaml: lora: write dotted keys"):
        compose("section", recipes_root)
    with pytest.raises(ParamsError, match="loops back"):
        compose("a", recipes_root)
    with pytest.raises(ParamsError, match="no recipe 'nope'.*recipes: a, b"):
        compose("nope", recipes_root)
    assert compose("extra", recipes_root)["train"]["sft"]["max_grad_norm"] == 0.5
    write(recipes_root, "unknown", "eval.temperature: 0.7\n")
    with pytest.raises(ParamsError, match="recipes/unknown.yaml: eval.temperature is not a params.yaml key"):
        compose("unknown", recipes_root)


@pytest.mark.e2e  # dvc exp run
def test_dvc_exp_run_applies_each_recipe_exactly(tmp_path):
    """The `-S` sets `make recipe` hands to DVC leave params.yaml equal to the composed recipe (lists, dicts, bools,
    numbers, a field params.yaml lacks, a dict that replaces another), on a one-stage project reading every section."""
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    write(tmp_path, "extra", "extends: seed/gpt-oss-20b\ntrain.sft.max_grad_norm: 0.5\n"
                             "train.sft.lr_scheduler_kwargs: {min_lr_rate: 0.2}\n")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"]["sft"]["lr_scheduler_kwargs"] = {"num_cycles": 3}  # replaced whole, not merged
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"noop": {"cmd": "echo ok", "params": list(params)}}}))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "x"]):
        run(cmd, tmp_path)
    names = [*RECIPES, "extra"]
    for name in names:
        run(exp_run_command(name, root=tmp_path), tmp_path)
        assert yaml.safe_load((tmp_path / "params.yaml").read_text()) == compose(name, tmp_path), name
        subprocess.run(["git", "checkout", "params.yaml"], cwd=tmp_path, check=True, env=git_env())
    assert compose("extra", tmp_path)["train"]["sft"]["lr_scheduler_kwargs"] == {"min_lr_rate": 0.2}
    assert sorted(run(["dvc", "exp", "list", "--name-only"], tmp_path).split()) == sorted(
        name.replace("/", "-") for name in names)


def test_make_recipe_refuses_a_bad_recipe_before_running_dvc(capsys):
    assert main(["no-such-recipe"]) == 2
    assert "no recipe 'no-such-recipe'" in capsys.readouterr().err
    assert main(["seed/qwen2-0.5b", "--dry-run"]) == 0
    assert "-S train.sft.gradient_accumulation_steps=4" in capsys.readouterr().out
