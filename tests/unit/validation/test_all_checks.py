"""Input checks that the validate stage runs before any other stage."""
import json

import pytest
import yaml

from conftest import MGSM
from lora_pipeline.data.local import check_data, local_rows
from lora_pipeline.evaluate.eval_checks import check_eval
from lora_pipeline.model.base_checks import check_model
from lora_pipeline.registry.gate import check_register, gate
from lora_pipeline.validation.all_checks import check_gate_data, check_split, most_rows
from conftest import ROOT
from lora_pipeline.config.params import Data, Eval, Model, Register, Split

SHIPPED = yaml.safe_load((ROOT / "params.yaml").read_text())


def shipped(cls, section: str, **changes):
    """A params section as params.yaml ships it, with some keys changed."""
    return cls.model_validate({**SHIPPED[section], **changes})


def mgsm_eval(**mgsm_changes) -> Eval:
    return shipped(Eval, "eval", mgsm={**SHIPPED["eval"]["mgsm"], **mgsm_changes})


def local_data(name: str) -> Data:
    return shipped(Data, "data", source="local", name=name, bad_rows="fail", max_chars=0)


def test_local_data_and_model_must_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "local").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="data.name: .*nope.jsonl does not exist"):
        check_data(local_data("data/local/nope.jsonl"))
    (tmp_path / "data" / "local" / "rows.xlsx").write_text("x")
    with pytest.raises(ValueError, match="data.name: .*rows.xlsx has suffix"):
        check_data(local_data("data/local/rows.xlsx"))
    with pytest.raises(FileNotFoundError, match=r"model.name: .* is not a model folder \(no config.json\)"):
        check_model(shipped(Model, "model", source="local", name=str(tmp_path)))
    check_data(shipped(Data, "data"))  # builtin needs no file
    check_model(shipped(Model, "model"))


@pytest.mark.parametrize("name", ["rows.jsonl", "data/rows.jsonl", "data/local/../rows.jsonl"])
def test_local_data_lives_under_data_local(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "local").mkdir(parents=True)
    (tmp_path / "data" / "rows.jsonl").write_text("{}")
    (tmp_path / "rows.jsonl").write_text("{}")
    with pytest.raises(ValueError, match=r"data.name: local data files live under data/local/"):
        check_data(local_data(name))


ROW = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'


@pytest.mark.parametrize("name, text, rows", [
    ("rows.jsonl", f"{ROW}\n\n{ROW}\nnot JSON\n", 3),  # blank lines are no rows, bad ones are
    ("rows.json", f"[{ROW}, {ROW}]", 2),
    ("rows.csv", 'prompt,completion\nq,"a, b"\n\nq2,"multi\nline"\n', 2),
    ("rows.tsv", "instruction\toutput\nq\ta\n", 1),
    ("rows.jsonl", b"\xff\xfe", None),  # not UTF-8: fetch names why
])
def test_local_rows_counts_what_fetch_reads(tmp_path, name, text, rows):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert local_rows(path) == rows


def test_a_local_file_too_small_to_split_is_refused_naming_the_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "local").mkdir(parents=True)
    (tmp_path / "data" / "local" / "five.jsonl").write_text(f"{ROW}\n" * 5)
    five = local_data("data/local/five.jsonl")
    with pytest.raises(ValueError, match=r"^split\.test_size: 0\.1 leaves 0 test and 5 train rows of at most 5 \(the "
                                         r"rows of data\.name data/local/five\.jsonl\); allowed: a fraction below 1 or "
                                         r"a whole row count that leaves at least 2 test rows and one to train$"):
        check_split(five, Split(test_size=0.1, seed=0))
    check_split(five, Split(test_size=2, seed=0))
    (tmp_path / "data" / "local" / "five.jsonl").write_text(f"{ROW}\n" * 50)
    check_split(five, Split(test_size=0.1, seed=0))
    with pytest.raises(ValueError, match=r"leaves 1 test and 9 train rows of at most 10 \(data\.max_rows\)"):
        check_split(five.model_copy(update={"max_rows": 10}), Split(test_size=0.1, seed=0))


@pytest.mark.parametrize("rows, test_size, allowed", [
    (20, 0.1, True), (20, 0.05, False), (3, 2, True), (2, 2, False), (2, 0.5, False), (10, 0.99, False),
])
def test_validate_and_split_share_one_rule(rows, test_size, allowed):
    from lora_pipeline.data.splitting import split_problem, split_rows

    assert (split_problem(rows, test_size) is None) == allowed
    if allowed:
        assert len(split_rows(list(range(rows)), test_size, seed=0)[0]) >= 1
    else:
        with pytest.raises(ValueError, match=r"^split\.test_size: "):
            split_rows(list(range(rows)), test_size, seed=0)


def test_eval_languages_and_mgsm_files(tmp_path):
    with pytest.raises(ValueError, match=r"unknown codes \['xx'\]"):
        check_eval(shipped(Eval, "eval", languages=["de", "xx"]))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        check_eval(mgsm_eval(path=str(tmp_path / "missing")))
    check_eval(mgsm_eval(path=""))  # skipped


@pytest.mark.skipif(not MGSM.is_dir(), reason=f"MGSM not at {MGSM}")
def test_mgsm_language_without_its_file():
    check_eval(mgsm_eval(path=str(MGSM), languages=["de", "zh", "ru"]))
    with pytest.raises(FileNotFoundError, match="mgsm_sw.tsv"):
        check_eval(mgsm_eval(path=str(MGSM), languages=["de", "sw"]))


def test_gate_metric_names_its_metrics_file():
    check_register(shipped(Register, "register", gate_metric="eval.test.loss"))
    with pytest.raises(ValueError) as refused:
        check_register(shipped(Register, "register", gate_metric="compliance.overall"))
    assert str(refused.value) == ("register.gate_metric 'compliance.overall' must start with train., merge. or eval. "
                                  "(the metrics file it comes from)")


def test_mixed_precision_on_a_cpu_is_refused_before_training():
    import torch

    from lora_pipeline.launch.machine import check_machine
    from lora_pipeline.config.params import Train

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    train = shipped(Train, "train", sft={**SHIPPED["train"]["sft"], "bf16": True})
    with pytest.raises(ValueError, match=r"train\.sft\.bf16 / train\.sft\.fp16: mixed precision needs a CUDA GPU"):
        check_machine(shipped(Model, "model"), train)
    check_machine(shipped(Model, "model"), shipped(Train, "train"))


@pytest.mark.parametrize("source, changes, expected", [
    ("builtin", {}, ("eval.compliance.overall", True)),
    ("local", {}, ("eval.test.loss", False)),
    ("hub", {}, ("eval.test.loss", False)),
    ("local", {"gate_metric": "eval.compliance.de"}, ("eval.compliance.de", True)),
    ("builtin", {"gate_metric": "eval.test.perplexity"}, ("eval.test.perplexity", False)),
    ("local", {"gate_greater_is_better": True}, ("eval.test.loss", True)),
])
def test_the_default_gate_fits_the_data(source, changes, expected):
    assert gate(shipped(Register, "register", **changes), source) == expected


def test_a_reasoning_gate_needs_rows_that_ask_for_a_reasoning_language(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/local").mkdir(parents=True)
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)]
    (tmp_path / "data/local/alpaca.json").write_text(json.dumps(rows))
    data = shipped(Data, "data", source="local", name="data/local/alpaca.json")
    check_gate_data(shipped(Register, "register"), data)  # auto: the held-out loss
    with pytest.raises(ValueError) as refused:
        check_gate_data(shipped(Register, "register", gate_metric="eval.compliance.overall"), data)
    assert str(refused.value) == ("register.gate_metric: 'eval.compliance.overall' needs rows that ask for a reasoning "
                                  "language, and no row of data/local/alpaca.json does; gate on the held-out loss "
                                  "(eval.test.loss, or auto)")
    rows[1]["system"] = "reasoning language: German"
    (tmp_path / "data/local/alpaca.json").write_text(json.dumps(rows))
    check_gate_data(shipped(Register, "register", gate_metric="eval.compliance.overall"), data)


def test_a_link_in_data_local_to_a_file_outside_the_repository_is_refused(tmp_path, monkeypatch):
    repo, outside = tmp_path / "repo", tmp_path / "elsewhere.jsonl"
    (repo / "data/local").mkdir(parents=True)
    outside.write_text('{"text": "a secret"}\n')
    (repo / "data/local/link.jsonl").symlink_to(outside)
    (repo / "data/local/inside.jsonl").write_text('{"text": "a"}\n')
    (repo / "data/local/inner.jsonl").symlink_to(repo / "data/local/inside.jsonl")
    monkeypatch.chdir(repo)
    data = shipped(Data, "data", source="local", name="data/local/link.jsonl")
    with pytest.raises(ValueError) as refused:
        check_data(data)
    assert str(refused.value) == (f"data.name: data/local/link.jsonl is a link to {outside}, outside the repository; "
                                  "copy the file into data/local/")
    assert most_rows(data) is None  # never read, not even counted
    check_data(shipped(Data, "data", source="local", name="data/local/inner.jsonl"))  # a link inside is a file
