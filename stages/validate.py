"""validate: params.yaml against its schema, each stage's declared keys, and the files it names.

    python -m stages.validate
Runs before every other stage, which all depend on its output. That output's content never changes, so a
valid change re-runs only the stages that read the changed keys; an invalid one stops the pipeline here,
naming the key or file, before any stage has removed its previous outputs.
"""
from pathlib import Path

from lora_pipeline import checks
from lora_pipeline.params import load_params

OUT = Path("data/params.ok")

params = load_params("validate")
for stage in ("fetch", "split", "train", "merge", "evaluate", "register"):
    load_params(stage)  # every key that dvc.yaml declares must exist in the schema
checks.check_data(params.data)
checks.check_model(params.model)
checks.check_library_fields(params.train, params.lora)
checks.check_machine(params.model, params.train)
checks.check_eval(params.eval)
checks.check_register(params.register)
OUT.parent.mkdir(exist_ok=True)
OUT.write_text("params.yaml is valid\n")
print("params.yaml is valid")
