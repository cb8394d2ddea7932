"""What register writes: one DVC output with nothing of this machine's store in it, and the store's record beside
it, which no stage declares; git ignores both, so a clone has neither and registers in its own store."""
import subprocess

import yaml

from conftest import ROOT
from lora_pipeline.registry.registration import RECORD, REGISTRATION, STAGE

DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def declared(entries) -> list[str]:
    return [entry if isinstance(entry, str) else next(iter(entry)) for entry in entries or []]


def test_register_declares_the_registration_and_no_stage_declares_the_record():
    stage = DVC_STAGES[STAGE]
    assert declared(stage.get("outs")) + declared(stage.get("metrics")) == [REGISTRATION.as_posix()]
    assert stage["outs"][0][REGISTRATION.as_posix()] == {"cache": False, "persist": True}  # never in DVC's cache
    for name, other in DVC_STAGES.items():
        written = declared(other.get("outs")) + declared(other.get("metrics")) + declared(other.get("plots"))
        assert RECORD.as_posix() not in written, name


def test_git_ignores_both():
    paths = [REGISTRATION.as_posix(), RECORD.as_posix()]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert ignored == paths
