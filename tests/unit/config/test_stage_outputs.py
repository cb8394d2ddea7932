"""lora_pipeline.config.outputs agrees with dvc.yaml, the pipeline's own record of what each stage writes, and with
trl.SFTConfig."""
import yaml

from conftest import ROOT
from lora_pipeline.config.outputs import METRICS, WRITTEN_BY
from lora_pipeline.train.sft_args import STAGE_OWNED_SFT_FIELDS, train_sft_args

DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def paths(entries) -> list[str]:
    """The paths of a dvc.yaml list of deps, outs or metrics (a path, or {path: options})."""
    return [entry if isinstance(entry, str) else next(iter(entry)) for entry in entries or []]


def test_each_metrics_file_is_one_its_stage_writes():
    assert WRITTEN_BY.keys() == METRICS.keys()
    for prefix, path in METRICS.items():
        stage = DVC_STAGES[WRITTEN_BY[prefix]]
        assert path.as_posix() in paths(stage.get("metrics")) + paths(stage.get("outs")), (prefix, path)


def test_no_other_stage_writes_them():
    for name, stage in DVC_STAGES.items():
        written = paths(stage.get("metrics")) + paths(stage.get("outs"))
        assert {prefix for prefix, path in METRICS.items() if path.as_posix() in written} <= \
            {prefix for prefix, writer in WRITTEN_BY.items() if writer == name}, name


def test_register_depends_on_exactly_the_metrics_files_it_logs():
    deps = [dep for dep in paths(DVC_STAGES["register"]["deps"]) if dep.startswith("metrics/")]
    assert sorted(deps) == sorted(path.as_posix() for path in METRICS.values())


def test_the_sft_fields_train_sets_are_sftconfig_fields():
    """Whatever the checkpoint interval and device, train sets the fields train.sft is refused, and each is a field
    of trl.SFTConfig's dataclass as installed and of the list validate reads."""
    import dataclasses

    from trl import SFTConfig

    from lora_pipeline.validation.all_checks import library_fields

    sftconfig_fields = {field.name for field in dataclasses.fields(SFTConfig)}
    for checkpoint_steps, on_gpu in ((0, False), (10, False), (0, True), (10, True)):
        assert set(train_sft_args(ROOT / "models/adapter", checkpoint_steps, on_gpu)) == STAGE_OWNED_SFT_FIELDS
    assert STAGE_OWNED_SFT_FIELDS <= sftconfig_fields, STAGE_OWNED_SFT_FIELDS - sftconfig_fields
    assert STAGE_OWNED_SFT_FIELDS <= set(library_fields()["trl.SFTConfig"])
