"""benchmarks/pipeline.sh's parts: the stand-ins at reduced size, the scratch copy, the per-stage recorder."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import MGSM, ROOT, run_env


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup = load("pipeline_setup")
record = load("pipeline_record")


@pytest.fixture(scope="module", params=["gpt-oss-20b", "qwen2-0.5b"])
def stand_in(request, tmp_path_factory):
    """The recipe's stand-ins at reduced size (--tiny), and its params composed over them."""
    recipe = request.param
    work = tmp_path_factory.mktemp(recipe)
    rows = setup.build_data(recipe, work / f"pipeline-{recipe}.jsonl", rows=200)
    from lora_pipeline.model.tiny import tokenizer_corpus

    built = setup.build_model(recipe, work / "model", tokenizer_corpus(rows), tiny=True)
    params = setup.compose_params(recipe, ROOT, work / "model", f"data/local/pipeline-{recipe}.jsonl",
                                  str(MGSM) if MGSM.is_dir() else None, None,
                                  layers=setup.TINY[recipe]["num_hidden_layers"])
    return SimpleNamespace(recipe=recipe, work=work, rows=rows, built=built, params=params)


def test_model_loads_as_the_stages_load_it(stand_in):
    from lora_pipeline.model.loading import load_model
    from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import is_mxfp4_checkpoint
    from lora_pipeline.config.params import validate

    model_params = validate(stand_in.params).model
    model = load_model(stand_in.work / "model", model_params)
    config = json.loads((stand_in.work / "model" / "config.json").read_text())
    assert model.config.vocab_size == setup.TINY[stand_in.recipe]["vocab_size"] == stand_in.built["vocab_size"]
    assert config["use_cache"] is True
    if stand_in.recipe == "gpt-oss-20b":
        assert model.config.model_type == "gpt_oss"
        assert config["quantization_config"]["quant_method"] == "mxfp4"
        assert is_mxfp4_checkpoint(stand_in.work / "model")
        assert model.config.num_local_experts == 4
    else:
        assert model.config.model_type == "qwen2" and "quantization_config" not in config
        assert config["dtype"] == "bfloat16"


def test_tokenizer_has_the_vocab_size_and_the_chat_template(stand_in):
    from lora_pipeline.model.loading import load_tokenizer

    tokenizer = load_tokenizer(stand_in.work / "model")
    assert len(tokenizer) == setup.TINY[stand_in.recipe]["vocab_size"]
    assert stand_in.built["bpe_entries"] < len(tokenizer)  # filled up with <|reserved_N|> entries
    text = tokenizer.apply_chat_template(stand_in.rows[0]["messages"], tokenize=False)
    marker = "<|channel|>final<|message|>" if stand_in.recipe == "gpt-oss-20b" else "<|im_start|>assistant"
    assert marker in text
    ids = tokenizer(stand_in.rows[0]["messages"][-1]["content"]).input_ids
    assert max(ids) < stand_in.built["bpe_entries"]  # text never encodes to a filler entry


def test_data_passes_the_fetch_row_checks(stand_in):
    from lora_pipeline.data.sources import clean_rows, read_local

    path = stand_in.work / f"pipeline-{stand_in.recipe}.jsonl"
    rows, counts = clean_rows(read_local(path, path.name), path.name, "fail", 0)
    assert len(rows) == counts["rows_kept"] == 200
    first = json.loads(path.read_text().splitlines()[0])
    if stand_in.recipe == "gpt-oss-20b":
        assert list(first) == list(setup.MT_COLUMNS)
        assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    else:
        assert set(first) == {"source", "messages"}
        assert {m["role"] for r in stand_in.rows for m in r["messages"]} == {"user", "assistant"}
        assert max(len(r["messages"]) for r in stand_in.rows) == 6


def test_params_are_the_recipe_over_the_stand_ins(stand_in):
    params = stand_in.params
    assert params["model"]["source"] == "local" and params["model"]["name"] == str(stand_in.work / "model")
    assert params["data"] == {**params["data"], "source": "local",
                              "name": f"data/local/pipeline-{stand_in.recipe}.jsonl"}
    assert params["train"]["accelerate_config"] == "single_gpu"
    assert params["train"]["liger"] is True  # the recipe's own values stay
    assert params["eval"]["mgsm"]["path"] in ("", str(MGSM))


def test_a_reduced_stand_in_keeps_no_more_layers_16_bit_than_it_has(stand_in):
    """The gpt-oss-20b recipe keeps more layers' experts in 16 bits than its reduced stand-in has: validate refuses
    the recipe over that stand-in, and accepts it cut to the stand-in's depth."""
    from lora_pipeline.config.params import validate
    from lora_pipeline.model.base_checks import check_packed_experts

    recipe = validate(setup.compose_params(stand_in.recipe, ROOT, stand_in.work / "model", "data/local/x.jsonl",
                                           None, None))
    cut = validate(stand_in.params)
    layers = setup.TINY[stand_in.recipe]["num_hidden_layers"]
    if stand_in.recipe == "qwen2-0.5b":
        assert recipe.train.experts_kept_16bit == cut.train.experts_kept_16bit == 0
        return
    assert recipe.train.experts_kept_16bit > layers == cut.train.experts_kept_16bit
    with pytest.raises(ValueError, match=f"train.experts_kept_16bit: .*has {layers} decoder layers"):
        check_packed_experts(recipe.model, recipe.lora, recipe.train, None, ROOT)
    check_packed_experts(cut.model, cut.lora, cut.train, None, ROOT)


@pytest.mark.parametrize("accelerate, batch_size", [(None, 320), ("multi_gpu", 40), ("multi_gpu_2", 160)])
def test_fewer_processes_evaluate_the_recipes_batches_at_once(tmp_path, accelerate, batch_size):
    # recipes/gpt-oss-20b.yaml: eval.batch_size 40 on multi_gpu's 8 processes; one GPU evaluates those 320 at once
    assert yaml.safe_load((ROOT / "recipes" / "gpt-oss-20b.yaml").read_text())["eval.batch_size"] == 40
    params = setup.compose_params("gpt-oss-20b", ROOT, tmp_path, "data/local/x.jsonl", None, accelerate)
    assert params["eval"]["batch_size"] == batch_size
    assert params["eval"]["accelerate_config"] == (accelerate or "single_gpu")


def test_params_errors_name_the_key(tmp_path):
    with pytest.raises(setup.SetupError, match="train.accelerate_config: no configs/accelerate/eight_gpus.yaml"):
        setup.compose_params("qwen2-0.5b", ROOT, tmp_path, "data/local/x.jsonl", None, "eight_gpus")
    with pytest.raises(setup.ParamsError, match="lora.r"):
        setup.compose_params("qwen2-0.5b", ROOT, tmp_path, "data/local/x.jsonl", None, None, ["lora.r=0"])
    with pytest.raises(setup.SetupError, match="MGSM_DIR=.*no mgsm_en.tsv.*MGSM_DIR=none"):
        setup.mgsm_folder(str(tmp_path))
    assert setup.mgsm_folder("none") is None


def test_copy_holds_the_project_files_and_no_outputs(tmp_path):
    setup.copy_repo(ROOT, tmp_path / "repo")
    copied = {str(p.relative_to(tmp_path / "repo")) for p in (tmp_path / "repo").rglob("*") if p.is_file()}
    assert {"dvc.yaml", "params.yaml", ".dvc/config", "stages/train.py", "data/local/README.md",
            "benchmarks/pipeline_setup.py"} <= copied
    assert not [p for p in copied if p.split("/")[0] in (".venv", ".git", ".whl") or p.startswith(
        ("data/raw", "data/split", ".dvc/cache", "models/base", "models/adapter", "models/merged"))]


def test_copy_again_keeps_the_earlier_runs_lock_and_metrics(tmp_path):
    repo = tmp_path / "repo"
    setup.copy_repo(ROOT, repo)
    for name in ("dvc.lock", "metrics/merge.json", "stages/train.py"):
        (repo / name).write_text("written by the run")
    setup.copy_repo(ROOT, repo)
    assert (repo / "dvc.lock").read_text() == (repo / "metrics/merge.json").read_text() == "written by the run"
    assert (repo / "stages/train.py").read_text() == (ROOT / "stages/train.py").read_text()  # code: this tree's


def test_copy_without_git_leaves_outputs_and_itself_out(tmp_path):
    source = tmp_path / "src"
    for name in ("dvc.yaml", "stages/a.py", "data/local/x.jsonl", "data/raw/data.jsonl", "models/base/w",
                 ".dvc/config", ".dvc/cache/ab", "data/local/pipeline-qwen2-0.5b.jsonl"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("x")
    (source / "work" / "model").mkdir(parents=True)
    (source / "work" / "model" / "config.json").write_text("{}")
    setup.copy_repo(source, source / "work" / "repo", exclude=source / "work")
    copied = sorted(str(p.relative_to(source / "work" / "repo"))
                    for p in (source / "work" / "repo").rglob("*") if p.is_file())
    assert copied == [".dvc/config", "data/local/x.jsonl", "dvc.yaml", "stages/a.py"]


def fake_repo(tmp_path: Path) -> Path:
    """Three stages: `a` writes a timing file under logs/, `b` fails, `c` would run last."""
    repo = tmp_path / "repo"
    (repo / "logs").mkdir(parents=True)
    (repo / "params.yaml").write_text("a: {msg: hello}\n")
    py = sys.executable
    stages = {
        "a": {"cmd": f"{py} -c \"import json; json.dump({{'tokens_per_s': 1}}, open('logs/a_speed.json', 'w'));"
                     f" print('${{a.msg}}')\"", "params": ["a.msg"]},
        "b": {"cmd": f"{py} -c \"import sys; print('boom'); sys.exit(3)\""},
        "c": {"cmd": f"{py} -c \"print('c')\""},
    }
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (repo / "logs" / "b_old.json").write_text("{}")  # written before b ran: not b's figures
    return repo


def test_stage_commands_resolve_params(tmp_path):
    repo = fake_repo(tmp_path)
    assert record.stage_names(repo) == ["a", "b", "c"]
    assert record.stage_cmd("a", repo).endswith("print('hello')\"")


def test_one_row_per_stage_until_the_first_failure(tmp_path, capsys):
    repo = fake_repo(tmp_path)
    out = tmp_path / "measurements" / "pipeline.jsonl"
    rows = record.run_pipeline(repo, "fake", out, "abc1234", use_dvc=False, echo=False)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == rows and [r["stage"] for r in rows] == ["a", "b"]
    a, b = rows
    assert {"recipe", "stage", "seconds", "peak_gib", "gpus", "commit", "date", "ran", "command",
            "status"} <= set(a)
    assert (a["recipe"], a["commit"], a["ran"], a["status"]) == ("fake", "abc1234", "cmd", 0)
    assert a["figures"] == {"a_speed.json": {"tokens_per_s": 1}} and "log_tail" not in a
    assert b["status"] == 3 and b["log_tail"].endswith("boom") and "figures" not in b
    assert (tmp_path / "logs" / "a.log").read_text() == "hello\n"
    table = record.table(rows)
    assert table.splitlines()[1].startswith("a ") and "exit 3" in table


def test_only_the_stages_named(tmp_path):
    repo = fake_repo(tmp_path)
    rows = record.run_pipeline(repo, "fake", tmp_path / "out.jsonl", "x", only=["c"], use_dvc=False, echo=False,
                               note="lora.r=16 after the whole pipeline")
    assert [(r["stage"], r["status"], r["note"]) for r in rows] == [("c", 0, "lora.r=16 after the whole pipeline")]
    with pytest.raises(SystemExit, match="no stage d in .*; stages: a, b, c"):
        record.run_pipeline(repo, "fake", tmp_path / "out.jsonl", "x", only=["d"], use_dvc=False)


def dvc_repo_without_git(tmp_path: Path, stages: dict, params: str = "{}\n") -> Path:
    """tmp_path/repo: DVC without git, as the pipeline's copy runs it (setup.dvc_config), with these stages and
    params.yaml."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (repo / "params.yaml").write_text(params)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=repo, check=True, env=run_env())
    setup.dvc_config(repo)
    return repo


@pytest.mark.e2e
def test_through_dvc_without_git_and_skipping_what_is_done(tmp_path):
    py = sys.executable
    repo = dvc_repo_without_git(tmp_path, {
        "make": {"cmd": f"{py} -c \"open('made.txt', 'w').write('x')\"", "outs": ["made.txt"]},
        "use": {"cmd": f"{py} -c \"open('used.txt', 'w').write(open('made.txt').read())\"", "deps": ["made.txt"],
                "outs": ["used.txt"]}})
    out = tmp_path / "out.jsonl"
    first = record.run_pipeline(repo, "fake", out, "x", use_dvc=True, echo=False)
    assert [(r["stage"], r["status"], r["ran"], r.get("skipped")) for r in first] == [
        ("make", 0, "dvc repro -s", None), ("use", 0, "dvc repro -s", None)]
    assert (repo / "used.txt").read_text() == "x"
    again = record.run_pipeline(repo, "fake", out, "x", use_dvc=True, echo=False)
    assert [r.get("skipped") for r in again] == [True, True]
    assert len(out.read_text().splitlines()) == 2  # skipped stages are not recorded


def test_stage_spans_from_dvcs_lines():
    lines = [(0.0, "Stage 'validate' didn't change, skipping"), (1.0, "Running stage 'train':"),
             (2.0, "> python x"), (5.0, "Updating lock file 'dvc.lock'"),
             (5.5, "Stage 'split' is cached - skipping run, checking out outputs"),
             (6.0, "Running stage 'merge':"), (8.0, "Running stage 'register':")]
    spans = record.stage_spans(lines, end=9.5)
    assert [(s["stage"], s["end"] - s["start"]) for s in spans] == [("train", 4.0), ("merge", 2.0),
                                                                      ("register", 1.5)]


@pytest.mark.e2e
def test_exp_run_after_the_pipeline_times_the_stages_it_reruns(tmp_path):
    py = sys.executable
    repo = dvc_repo_without_git(tmp_path, {
        "make": {"cmd": f"{py} -c \"open('made.txt', 'w').write('x')\"", "outs": ["made.txt"]},
        # the stage sleeps a moment: a span of DVC's lines rounds to 0.0 s for a command quicker than 0.05 s
        "scale": {"cmd": f"{py} -c \"import json, time; time.sleep(0.3);"
                         f" json.dump({{'n': ${{a.n}}}}, open('logs/scale.json', 'w'));"
                         f" open('scaled.txt', 'w').write(open('made.txt').read() * ${{a.n}})\"",
                  "deps": ["made.txt"], "params": ["a.n"], "outs": ["scaled.txt"]}}, params="a: {n: 1}\n")
    (repo / ".gitignore").write_text("/made.txt\n/scaled.txt\n/logs/\n")
    (repo / "logs").mkdir()
    out = tmp_path / "out.jsonl"
    record.run_pipeline(repo, "fake", out, "x", use_dvc=True, echo=False)
    (repo / "big.bin").write_bytes(b"\0" * (record.LARGEST_COMMITTED_BYTES + 1))
    with pytest.raises(SystemExit, match=r"big.bin in .* would be committed .*list it in a .gitignore"):
        record.exp_run(repo, "fake", out, "x", ["a.n=3"], echo=False)
    (repo / "big.bin").unlink()
    rows = record.exp_run(repo, "fake", out, "x", ["a.n=3"], echo=False, note="round trip")
    assert [(r["stage"], r["status"], r["ran"], r["command"]) for r in rows] == [
        ("scale", 0, "dvc exp run", "dvc exp run -S a.n=3"), ("exp run", 0, "dvc exp run", "dvc exp run -S a.n=3")]
    scale, whole = rows
    assert scale["figures"] == {"scale.json": {"n": 3}} and scale["note"] == "round trip"
    assert whole["stages"] == ["scale"] and 0 < scale["seconds"] <= whole["seconds"]
    assert (repo / "scaled.txt").read_text() == "xxx"
    assert [json.loads(line)["ran"] for line in out.read_text().splitlines()] == ["dvc repro -s"] * 2 + [
        "dvc exp run"] * 2
    listed = subprocess.run([py, "-m", "dvc", "exp", "list", "--all-commits", "--name-only"], cwd=repo,
                            capture_output=True, text=True, env=run_env(), check=True).stdout
    assert len(listed.split()) == 1  # the experiment DVC recorded
