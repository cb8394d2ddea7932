"""Same params and code, two clones at different paths: byte-identical data, adapter, merged model and metrics."""
import yaml

from conftest import copy_repo, run, set_params

SHORT_RUN = {"data.builtin_rows": 300, "model.tiny.pretrain_steps": 20, "train.sft.max_steps": 12,
             "train.checkpoint_steps": 4}
OUTPUTS = ["data/raw", "data/split", "models/base", "models/adapter", "models/merged", "metrics/train.json",
           "metrics/merge.json", "plots/train_loss.csv"]


def output_md5s(repo) -> dict:
    """md5 of every output of the stages up to merge, as dvc.lock records them."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])
            if out["path"] in OUTPUTS}


def test_two_clones_produce_the_same_bytes(tmp_path):
    md5s = []
    for name in ("first", "second-clone-elsewhere"):
        repo = copy_repo(tmp_path / name / "repo")
        set_params(repo, **SHORT_RUN)
        run(["dvc", "repro", "merge"], repo)
        md5s.append(output_md5s(repo))
        assert str(repo) not in (repo / "models/adapter/adapter_config.json").read_text()
        assert "seconds" not in (repo / "metrics/train.json").read_text()
    assert set(md5s[0]) == set(OUTPUTS)
    assert md5s[0] == md5s[1]
