"""Input checks that the validate stage runs before any other stage."""
import pytest
import yaml

from conftest import MGSM
from lora_pipeline.data import check_data
from lora_pipeline.metrics import check_eval, check_register
from lora_pipeline.modeling import check_model
from conftest import ROOT
from lora_pipeline.params import Data, Eval, Model, Register

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
    with pytest.raises(ValueError, match="register.gate_metric 'compliance.overall'"):
        check_register(shipped(Register, "register", gate_metric="compliance.overall"))


def test_mixed_precision_on_a_cpu_is_refused_before_training():
    import torch

    from lora_pipeline.launch import check_machine
    from lora_pipeline.params import Train

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    train = shipped(Train, "train", sft={**SHIPPED["train"]["sft"], "bf16": True})
    with pytest.raises(ValueError, match=r"train\.sft\.bf16 / train\.sft\.fp16: mixed precision needs a CUDA GPU"):
        check_machine(shipped(Model, "model"), train)
    check_machine(shipped(Model, "model"), shipped(Train, "train"))
