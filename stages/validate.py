"""validate: params.yaml against its schema, each stage's declared keys, and the files, model and machine it names.

    python -m stages.validate
Runs before every other stage, which all depend on its output. That output's content never changes, so a
valid change re-runs only the stages that read the changed keys; an invalid one stops the pipeline here,
naming each bad key, before any stage has removed its previous outputs. The digest of the params it checked goes
to logs/params_digest (no DVC output): each later stage of the run compares params.yaml with it before any work
(lora_pipeline.config.params.stop_if_changed_since_validate).
"""
import sys
from pathlib import Path

from lora_pipeline.config.dvcfiles import read_yaml
from lora_pipeline.config.outputs import write_text
from lora_pipeline.config.params import DIGEST, ParamsError, ROOT, params_digest
from lora_pipeline.registry.gate import gate
from lora_pipeline.validation.all_checks import validate_all

OUT = Path("data/params.ok")


def main():
    try:
        params = validate_all(read_yaml(ROOT / "params.yaml"))
    except ParamsError as exc:
        sys.exit(f"validate: {exc}")
    write_text(ROOT / DIGEST, params_digest(params) + "\n")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("params.yaml is valid\n")
    print("params.yaml is valid")
    if params.data.source != "builtin":  # the registered model's name is the default's unless register.model_name says
        metric, greater = gate(params.register, params.data.source)
        print(f"data: {params.data.source} {params.data.name}, not the built-in set: the model will be registered as "
              f"'{params.register.model_name}' (register.model_name), gated on {metric} "
              f"({'higher' if greater else 'lower'} is better)")


if __name__ == "__main__":
    main()
