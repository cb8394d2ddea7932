"""fetch: the data set's usable rows to data/raw (counts in metrics/data.json) and the base model to models/base.

    python -m stages.fetch
Rows of any format that lora_pipeline/data/formats.py reads (data.format, or the one detected from the first row, which
metrics/data.json records) are written as messages rows. A bad row stops the stage with one line naming the file, row
and field (data.bad_rows: fail), or is dropped and counted per reason (drop); an exact duplicate is dropped and counted
(data.duplicates: drop) or stops it (fail). Image, audio or video data, and a Hub that is offline or unreachable,
stop it with one line naming the row and field, or the id and revision.
Both outputs are written to staging folders and moved into place only once both are complete, so a failure never
leaves half a download (or new data beside an old model) where the outputs were; they are `persist` in dvc.yaml, so
under `dvc repro` too a failed fetch leaves them, and metrics/data.json, as they were.
"""
import shutil
import sys
from pathlib import Path

from lora_pipeline.config.outputs import replace_dir, staging_dir, write_json, write_jsonl
from lora_pipeline.config.params import load_params
from lora_pipeline.data.hub import HubUnreachable, download_model
from lora_pipeline.data.rows import DataError
from lora_pipeline.data.sources import load_data
from lora_pipeline.model.base_checks import check_model

RAW, BASE, METRICS = Path("data/raw"), Path("models/base"), Path("metrics/data.json")
KEPT = f"{RAW}, {BASE} and {METRICS} are as they were"


def main():
    params = load_params("fetch")
    data, model = params.data, params.model
    raw, base = staging_dir(RAW), staging_dir(BASE)
    try:
        rows, counts, data_format = load_data(data)
        write_jsonl(rows, raw / "data.jsonl")
        write_json(raw / "source.json", {"source": data.source, "name": data.name, "revision": data.revision,
                                         "rows": len(rows)})
        if model.source in ("tiny-qwen2", "tiny-gpt-oss"):
            from lora_pipeline.model.tiny import build_tiny

            losses = build_tiny(model.source, rows, model.tiny, base)
            if losses:
                print(f"tiny base pretrained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        elif model.source == "hub":
            download_model(model.name, model.revision, base)
        else:
            check_model(model)
            shutil.copytree(model.name, base, dirs_exist_ok=True)
    except BaseException as exc:  # failed or interrupted: drop what was staged; the outputs stay as they were
        shutil.rmtree(raw, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        if isinstance(exc, (DataError, HubUnreachable)):
            sys.exit(f"fetch: {exc}; {KEPT}")
        raise
    replace_dir(raw, RAW)
    replace_dir(base, BASE)
    write_json(METRICS, {"format": data_format, **counts})
    dropped = ", ".join(f"{n} {reason}" for reason, n in counts["dropped"].items())
    detected = " (detected)" if data.format == "auto" and data.source != "builtin" else ""
    print(f"data: {len(rows)} rows from {data.source} {data.name}, format {data_format}{detected} -> {RAW}"
          + (f" (dropped: {dropped})" if dropped else ""))
    print(f"model: {model.source} {model.name} -> {BASE}")


if __name__ == "__main__":
    main()
