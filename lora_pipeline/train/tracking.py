"""Where MLflow runs go (the tracking URI, bounded retries), and the train stage's live run: per-step figures sent
by a background thread as they come, kept in logs/ until the server has them, so training never waits on MLflow."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import mlflow
from mlflow import MlflowClient

from lora_pipeline.config.errors import chain
from lora_pipeline.config.outputs import write_json

log = logging.getLogger(__name__)
# MLflow's progress notes (creating or migrating a sqlite store, the system metrics monitor starting and stopping);
# their warnings and errors still show
for _name in ("mlflow.store.db.utils", "alembic", "mlflow.system_metrics"):
    logging.getLogger(_name).setLevel(logging.WARNING)

# A stopped or unreachable server fails the register stage in about 30 s (retries after 0, 4, 8, 16 s) instead of
# MLflow's several minutes per request, and bounds each attempt of train's sender thread alike; each of these MLflow
# variables, when set, wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def _repo(root: Path) -> Path:
    """The repository that holds the local store: DVC's temp experiment runs point DVC_ROOT at their parent."""
    return Path(os.environ.get("DVC_ROOT") or root).resolve()


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else a sqlite store in the repository."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_repo(root) / 'mlflow.db'}"


def redact(uri: str) -> str:
    """The URI with any password (or token given as the user part) replaced by ***."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, has_password, _ = userinfo.partition(":")
    hidden = f"{user}:***" if has_password else "***"
    return urlunsplit(parts._replace(netloc=f"{hidden}@{host}"))


def portable_uri(uri: str, root: Path) -> str:
    """The URI as it may be written into a tracked file: redacted, and a local sqlite store relative to the repo."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if path.is_absolute():
            return f"sqlite:///{os.path.relpath(path, _repo(root))}"
    return redact(uri)


def _without_credentials(uri: str) -> str:
    """The URI minus user:password, which go to MLflow's own variables (so MLflow never prints them)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.password is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def connect(root: Path) -> str:
    """Point MLflow at the store with bounded retries. Returns the URI as given (with any credentials: redact it
    before showing it)."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = tracking_uri(root)
    os.environ["MLFLOW_TRACKING_URI"] = _without_credentials(uri)
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    return uri


def use_experiment(name: str, root: Path) -> str:
    """connect(), then make `name` the active experiment (created if missing). Returns the URI as given."""
    uri = connect(root)
    experiment_id(MlflowClient(), name, root)
    mlflow.set_experiment(name)
    return uri


def unreachable(exc: BaseException) -> str | None:
    """Why MLflow could not be reached (e.g. "Failed to establish a new connection: [Errno 111] Connection
    refused"), or None if `exc` is another error."""
    import requests

    lost = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError)
    for error in chain(exc):
        if isinstance(error, lost):
            inner = error.args[0] if error.args else error
            inner = getattr(inner, "reason", inner)  # urllib3's MaxRetryError: the last attempt's error
            text = inner.args[0] if getattr(inner, "args", None) and isinstance(inner.args[0], str) else str(inner)
            return re.sub(r"^<[^>]*>: ", "", text)[:200]
    return None


def end_run_failed() -> None:
    """Mark the active run FAILED with a single attempt: after a connection error, retrying only delays the exit."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        mlflow.end_run("FAILED")
    except Exception:  # the server is gone; the next register run marks this run FAILED
        pass


def experiment_id(client: MlflowClient, name: str, root: Path) -> str:
    """The experiment's id, created if missing; local stores keep artifacts in <repo>/mlartifacts."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = (_repo(root) / "mlartifacts").as_uri() if tracking_uri(root).startswith("sqlite:") else None
    return client.create_experiment(name, artifact_location=location)


# The train stage's live run. The state names the run and how many records it holds; the records file holds every
# step's figures, one JSON line each, whether or not the server has them yet.
LIVE_STATE, LIVE_RECORDS = Path("logs/train_mlflow.json"), Path("logs/train_metrics.jsonl")
STEP_PREFIX = "train.step_"  # train.step_loss, train.step_learning_rate, ...
FINISH_WAIT_S = 30  # at the end of training, the longest wait for the server to take what is left
_RECORDS_PER_BATCH = 100  # under MLflow's 1000 metrics per log_batch call


def read_records() -> list[dict]:
    records = []
    for line in LIVE_RECORDS.read_text().splitlines() if LIVE_RECORDS.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line, cut by a kill while it was written
            pass
    return records


def log_records(client: MlflowClient, run_id: str, records: list[dict],
                delivered: Callable[[int], None] | None = None) -> None:
    """Step records ({step, time, metrics}) as train.step_<name> metrics of the run, at their own step and time, a
    batch at a time; delivered(n), if given, is called after each batch the server took."""
    from mlflow.entities import Metric

    for i in range(0, len(records), _RECORDS_PER_BATCH):
        chunk = records[i:i + _RECORDS_PER_BATCH]
        metrics = [Metric(STEP_PREFIX + key, float(value), r["time"], r["step"])
                   for r in chunk for key, value in r["metrics"].items()]
        client.log_batch(run_id, metrics=metrics, synchronous=True)
        if delivered:
            delivered(len(chunk))


def _missing(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


class LiveRun:
    """Rank 0's MLflow run of one training, the same run again when a killed training resumes. record() appends to
    logs/ and wakes the sender thread, which opens the run and delivers what the server does not have yet, retrying
    while it is unreachable; MLflow's system metrics (CPU, memory, GPU with nvidia-ml-py) are sampled into the same
    run while the server answers. transformers' MLflowCallback calls MLflow on the training thread instead, and what
    an unreachable server did not take is lost."""

    def __init__(self, experiment: str, fingerprint: str, root: Path, run_name: str | None = None,
                 tags: dict | None = None):
        uri = connect(root)
        self.where = redact(uri)
        fresh = {"fingerprint": fingerprint, "tracking_uri": portable_uri(uri, root), "experiment": experiment,
                 "run_id": None, "sent": 0, "finished": False}
        state = json.loads(LIVE_STATE.read_text()) if LIVE_STATE.is_file() else {}
        # The same unfinished training, tracked in the same place: it resumes its run and keeps its records.
        same = not state.get("finished") and all(state.get(k) == fresh[k] for k in
                                                 ("fingerprint", "tracking_uri", "experiment"))
        self.state = state if same else fresh
        self.records = read_records() if same else []
        LIVE_RECORDS.parent.mkdir(parents=True, exist_ok=True)
        LIVE_RECORDS.write_text("".join(json.dumps(r) + "\n" for r in self.records))  # whole lines only
        self._save()
        self.root, self.run_name, self.tags = root, run_name, tags or {}
        self.error, self._status, self._system = None, None, None
        self._lock, self._wake, self._closing = threading.Lock(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._send, name="mlflow-live", daemon=True)
        self._thread.start()

    def _save(self) -> None:
        write_json(LIVE_STATE, self.state)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """One step's figures: on disk at once, to MLflow as soon as the sender gets to them."""
        entry = {"step": int(step), "time": int(time.time() * 1000), "metrics": metrics}
        with open(LIVE_RECORDS, "a") as f:
            f.write(json.dumps(entry) + "\n")
        with self._lock:
            self.records.append(entry)
        self._wake.set()

    def finish(self, status: str = "FINISHED", adapter_hash: str | None = None) -> str | None:
        """End the run with `status` after delivering what is left, waiting at most FINISH_WAIT_S. Returns a line
        saying what the server did not get, or None."""
        with self._lock:
            self.state.update(finished=status == "FINISHED", adapter=adapter_hash)
            self._save()
            self._status = status
        self._closing.set()
        self._wake.set()
        self._thread.join(FINISH_WAIT_S)
        with self._lock:
            unsent = len(self.records) - self.state["sent"]
        if not unsent and not self._thread.is_alive():
            return None
        return (f"MLflow at {self.where} did not take the training's figures ({self.error or 'no answer'}): "
                f"{unsent} of {len(self.records)} step records kept in {LIVE_RECORDS}; the register stage delivers "
                "them to the run")

    def _send(self) -> None:
        client, delay = MlflowClient(), 1.0
        while True:
            if self.error:  # the server is away: retry after a while (new records only add to the file)
                self._closing.wait(delay)
            else:
                self._wake.wait()
                self._wake.clear()
            closing = self._status
            try:
                self._deliver(client)
                if closing:
                    self._system.finish()  # its last samples, then the run's end
                    client.set_terminated(self.state["run_id"], closing)
                self.error, delay = None, 1.0
            except Exception as exc:  # never into training: kept, reported by finish(), delivered later
                if self.error is None:
                    log.warning("MLflow at %s: %s; step records wait in %s", self.where,
                                unreachable(exc) or exc, LIVE_RECORDS)
                self.error = unreachable(exc) or f"{type(exc).__name__}: {exc}"[:200]
                delay = min(delay * 2, 60.0)
            if closing:
                return

    def _deliver(self, client: MlflowClient) -> None:
        if self._system is None:  # first contact: open the run (again, after a kill)
            self._open(client)
        with self._lock:
            pending = self.records[self.state["sent"]:]
        log_records(client, self.state["run_id"], pending, self._delivered)

    def _delivered(self, count: int) -> None:
        with self._lock:
            self.state["sent"] += count
            self._save()

    def _open(self, client: MlflowClient) -> None:
        run_id, resumed = self.state["run_id"], False
        if run_id is not None:
            try:
                resumed = client.get_run(run_id).info.lifecycle_stage == "active"
            except Exception as exc:
                if not _missing(exc):
                    raise
        if resumed:
            client.update_run(run_id, status="RUNNING")
        else:  # a new training, or its run is gone from the server: a new run that gets every record
            exp = experiment_id(client, self.state["experiment"], self.root)
            run_id = client.create_run(exp, run_name=self.run_name, tags=self.tags).info.run_id
            with self._lock:
                self.state.update(run_id=run_id, sent=0)
                self._save()
        self._system = _system_metrics(run_id, resumed)


class _NoSystemMetrics:
    def finish(self):
        pass


def _system_metrics(run_id: str, resumed: bool):
    """MLflow's own sampler of CPU, memory, disk, network (and GPU where nvidia-ml-py is installed), if psutil is."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=resumed)
    except Exception as exc:  # psutil missing
        log.warning("no MLflow system metrics: %s", exc)
        return _NoSystemMetrics()
    monitor.start()
    return monitor


def finished_training(client: MlflowClient, uri: str, root: Path, experiment: str, adapter: Path):
    """What the train stage left in logs/ for the adapter now on disk, or None if that was another training:
    (state, every step record, its run if this server has it in `experiment`, else None)."""
    from lora_pipeline.launch.checkpoints import content_hash

    state = json.loads(LIVE_STATE.read_text()) if LIVE_STATE.is_file() else {}
    if not state.get("finished") or state.get("adapter") != content_hash(adapter):
        return None
    run = None
    if state.get("run_id") and state.get("tracking_uri") == portable_uri(uri, root):
        try:
            run = client.get_run(state["run_id"])
        except Exception as exc:
            if not _missing(exc):
                raise
        exp = client.get_experiment_by_name(experiment)
        if run is not None and (exp is None or run.info.experiment_id != exp.experiment_id
                                or run.info.lifecycle_stage != "active"):
            run = None
    return state, read_records(), run


def deliver_late(client: MlflowClient, state: dict, records: list[dict], run_id: str) -> int:
    """Send the records the train stage could not deliver to its run (tagged train_records_late: how many)."""
    late = records[state.get("sent", 0):]
    if late:
        log_records(client, run_id, late)
        client.set_tag(run_id, "train_records_late", str(len(late)))
        write_json(LIVE_STATE, {**state, "sent": len(records)})
    return len(late)
