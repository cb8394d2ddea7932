"""validate: params.yaml against its schema, each stage's declared keys, and the files, model and machine it names.

    python -m stages.validate
Runs before every other stage, which all depend on its output. That output's content never changes, so a
valid change re-runs only the stages that read the changed keys; an invalid one stops the pipeline here,
naming each bad key, before any stage has removed its previous outputs.
"""
import sys
from pathlib import Path

import yaml

from lora_pipeline.checks import validate_all
from lora_pipeline.params import ROOT, ParamsError

OUT = Path("data/params.ok")

try:
    validate_all(yaml.safe_load((ROOT / "params.yaml").read_text()))
except ParamsError as exc:
    sys.exit(f"validate: {exc}")
OUT.parent.mkdir(exist_ok=True)
OUT.write_text("params.yaml is valid\n")
print("params.yaml is valid")
