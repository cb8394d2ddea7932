"""register: completes this pipeline run's MLflow run (tags, params, metrics, per-step figures) and registers the model.

    python -m stages.register
The run is the one the train stage opened for the adapter on disk (logs/train_mlflow.json), when this server has it
and no register completed it yet; step records the train stage could not deliver are sent to it first. Otherwise
(register re-run alone, e.g. only eval or gate params changed; a training restored from DVC's cache; another
server) a new run, tagged train_run_id when the train run is on this server, with the per-step figures again.
The new version gets the alias `candidate`; it becomes `champion` only if register.gate_metric (auto: the built-in
data's compliance, other data's held-out loss) beats the current champion's. Outputs already logged (same md5s in
dvc.lock) log nothing; a new run whose model is already registered (e.g. only eval params changed) logs its run and
links the existing version. An unreachable
server fails the stage in bounded time with one line, models/registered.json untouched.
It writes models/registered.json (this machine's store: version, aliases, run), which no stage declares, then its
DVC output models/registration.json (the model, pipeline run and gate figure: the same on every machine, so
dvc.lock records no machine's run). Neither is in git or a DVC remote, so in a clone, where the output is missing,
`dvc repro` runs this stage, which registers the model in the clone's own store.
"""
import os

# Everything registered is on disk; offline, MLflow does not wait on the Hub for a model card it cannot use.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lora_pipeline.config.outputs import write_json
from lora_pipeline.config.params import ROOT, load_params
from lora_pipeline.registry import registration
from lora_pipeline.registry.gate import gate


def main():
    params = load_params("register")
    metrics = registration.stage_metrics(gate(params.register, params.data.source)[0])
    registered, record = registration.register_pipeline_run(params, metrics, ROOT)
    write_json(registration.RECORD, record)
    write_json(registration.REGISTRATION, registered)
    print(registration.RECORD.read_text())


if __name__ == "__main__":
    main()
