"""Shared fixtures: offline environment, the repository root, MGSM's location, a tiny model on disk."""
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile in the tests (and in the stages they start) compiles in its own process, not in Inductor's pool of
# compile workers: torch 2.13's pool waits forever for a worker that died (pytorch/pytorch#189290), which hung a test
# run. With two test workers on two cores, a pool gains nothing; the generated code is the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]

# A test (its fixtures included) still running after this long has its innermost frames and its processes printed to
# the terminal, past pytest's capture, and again each time as long again; it goes on running. A log cut short by a
# hang then names the test in its last lines.
STALL_REPORT_EVERY_S = 900
_terminal = {}


def pytest_configure(config):
    _terminal["fd"] = os.dup(2)  # pytest's capture is off here: fd 2 is the terminal (or CI's log)


def stall_report(nodeid: str, thread_id: int, minutes: float) -> str:
    frame = sys._current_frames().get(thread_id)
    frames = [f"  {Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()[:90]}"
              for f in (traceback.extract_stack(frame) if frame else [])
              if not re.search(r"^<|/(_pytest|pluggy|xdist|execnet)/", f.filename)][-8:]  # the test's own frames
    children = psutil.Process().children(recursive=True)
    processes = [described(child) for child in children]
    holders = [described(process) for process in pipe_holders(exclude={child.pid for child in children})]
    detached = [described(process) for process in detached_processes()]
    return "\n".join([f"\n[stalled? {minutes:.0f} min] its processes ({len(processes)}):", *processes[-5:],
                      f"other processes holding a pipe it reads ({len(holders)}):", *holders[-5:],
                      f"other processes of this environment ({len(detached)}):", *detached[-8:], *slurm_state(),
                      "its innermost frames:", *frames, f"[stalled? {minutes:.0f} min] {nodeid}", ""])


def slurm_state() -> list[str]:
    """The test Slurm's jobs (with why a pending one waits) and nodes, while one runs for the tests."""
    if "SLURM_CONF" not in os.environ:
        return []
    lines = []
    for cmd in (["squeue", "-h", "-o", "  job %i %j %T %r %N"], ["sinfo", "-h", "-N", "-o", "  node %N %t %E"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            lines += subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()
    return ["Slurm:", *lines[-8:]]


def described(process: psutil.Process) -> str:
    status = "gone"
    try:
        status = process.status()
        return f"  pid {process.pid} {status}: {' '.join(process.cmdline())[:140]}"
    except psutil.Error:  # a zombie has no command line left
        return f"  pid {process.pid} {status}"


def pipes(pid: int, reading: bool = False) -> set[str]:
    """The pipes a process holds ("pipe:[inode]"); with reading, only those it reads past its standard streams."""
    folder = f"/proc/{pid}"
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{folder}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{folder}/fd/{fd}")
                if link.startswith("pipe:") and (not reading or int(fd) > 2 and _read_only(f"{folder}/fdinfo/{fd}")):
                    found.add(link)
    return found


def _read_only(fdinfo: str) -> bool:
    flags = next(line for line in Path(fdinfo).read_text().splitlines() if line.startswith("flags:"))
    return int(flags.split()[1], 8) & 3 == os.O_RDONLY


def pipe_holders(exclude: set[int]) -> list[psutil.Process]:
    """The processes, other than those excluded and this one's ancestors, that hold a pipe this process reads: what a
    read of a command's output waits for once the command has exited (a process it left behind)."""
    reading = pipes(os.getpid(), reading=True)
    exclude = exclude | {os.getpid()} | {parent.pid for parent in psutil.Process().parents()}
    return [process for process in psutil.process_iter() if process.pid not in exclude and pipes(process.pid) & reading]


def detached_processes() -> list[psutil.Process]:
    """Processes that run this environment's tools outside this pytest run's process tree: those a command left in
    the background, such as DVC's queue workers and what they started (srun's command names this environment too)."""
    ancestors = psutil.Process().parents()
    root = ([process for process in ancestors if "pytest" in " ".join(process.cmdline())] or [psutil.Process()])[-1]
    ours = {root.pid} | {process.pid for process in [*root.children(recursive=True), *ancestors]}
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if process.pid not in ours and sys.prefix in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    done, thread_id, started = threading.Event(), threading.get_ident(), time.monotonic()

    def report_while_running():
        while not done.wait(STALL_REPORT_EVERY_S):
            report = stall_report(item.nodeid, thread_id, (time.monotonic() - started) / 60)
            os.write(_terminal.get("fd", 2), report.encode(errors="replace"))

    threading.Thread(target=report_while_running, daemon=True).start()
    yield
    done.set()

MGSM = ROOT.parent / "shared" / "data" / "mgsm"
# What a copy of the repository leaves out: local environments, stores and everything DVC produces.
# Outputs, run state (checkpoints of an interrupted training, logs) and local tool folders stay behind.
# What copy_repo leaves out: tools' state at any depth (.dvc/cache, .dvc/tmp ...), outputs and docs at the top only,
# since a source folder may share an output's name (lora_pipeline/data is code).
IGNORED_ANYWHERE = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", "cache", "tmp", ".whl*",
                                          ".bench")
IGNORED_AT_TOP = {"mlflow.db", "mlartifacts", "mlruns", "data", "models", "metrics", "plots", "reports", "checkpoints",
                  "logs", "docs", "measurements"}


def copy_ignore(folder: str, names: list[str]) -> set[str]:
    ignored = set(IGNORED_ANYWHERE(folder, names))
    return ignored | (IGNORED_AT_TOP & set(names)) if Path(folder) == ROOT else ignored


# Fixtures that run the pipeline, a training, DVC or an MLflow model (or build on one that does): their tests are e2e.
E2E_FIXTURES = {"repo", "short_runs", "short_repo", "registered", "server", "remotes", "queued", "default_pipeline",
                "pipeline_copy", "slurm_cluster"}


# Session fixtures that run a pipeline. make test runs two pytest-xdist workers (--dist loadgroup): every test that
# uses one runs on the same worker, so that each is built once and its tests run in the order a single process
# would run them; the two groups come first, one per worker, since they are the longest chains of the suite.
# Next come the e2e tests that build what they need themselves, each module a unit of minutes: the worker that ends
# short_runs first takes them while the other is still building the default in repo's chain. Then the tests that
# work in a copy of the built default (default_pipeline), which is there by then, and the unit tests last: many short
# modules, which even out the two workers' ends instead of leaving one worker alone with a long e2e module.
SHARED_PIPELINES = ("repo", "short_runs")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    """Every test is e2e (marked so, or using an E2E_FIXTURES fixture) or else unit, the fast part. An e2e test
    runs on the worker of the session pipeline it uses, or in the xdist_group it names (a test that builds what it
    needs in a copy of its own, which may run beside its module's others), or else beside the rest of its module."""
    def shared_pipeline(item) -> str | None:
        defs = item._fixtureinfo.name2fixturedefs
        return next((name for name in SHARED_PIPELINES if name in defs and defs[name][-1].scope == "session"), None)

    for item in items:
        if item.get_closest_marker("e2e") is None and E2E_FIXTURES.isdisjoint(item.fixturenames):
            item.add_marker(pytest.mark.unit)
            continue
        item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(shared_pipeline(item) or item.module.__name__))
    def rank(item) -> int:
        group = shared_pipeline(item)
        if group:
            return SHARED_PIPELINES.index(group)
        if item.get_closest_marker("unit"):
            return len(SHARED_PIPELINES) + 3
        if "default_pipeline" not in item.fixturenames:
            return len(SHARED_PIPELINES)
        # of the tests in copies of the default, the Slurm module (minutes, one chain) before the short ones
        return len(SHARED_PIPELINES) + 1 + ("slurm_cluster" not in item.fixturenames)

    # then by file name, whatever folder a file is in (tests/unit/<concern>/, tests/e2e/): a group's tests run in one
    # order however the files are laid out, and repo's chain relies on it (test_registry expects what the experiments
    # of test_pipeline and test_quantization registered); stable, so each file keeps its own order
    items.sort(key=lambda item: (rank(item), item.path.name))


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores: OpenMP threads sleep while they wait instead of spinning, so that neither worker's
    # pipelines hold a core the other needs. Waiting does not change what is computed.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def copy_repo(dest: Path) -> Path:
    """The project's files (no outputs) in a fresh git repository at dest."""
    shutil.copytree(ROOT, dest, ignore=copy_ignore)
    shutil.copytree(ROOT / "data" / "local", dest / "data" / "local")  # local data files: a dependency of fetch
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True, env=git_env())
    return dest


def git_env() -> dict:
    return {**os.environ, "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
            "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}


def run_env(**extra) -> dict:
    """The environment for a command under test: this Python's tools first on PATH, no outside MLflow/DVC state."""
    env = {k: v for k, v in git_env().items() if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    # DVC runs a stage's command with $SHELL -c, /bin/sh where SHELL is unset. Debian's /bin/sh (dash) does not exec
    # the command: the shell stays between DVC and it, as on any machine whose SHELL is unset.
    env["SHELL"] = "/bin/sh"
    return {**env, **extra}


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None) -> str:
    """Run a command in run_env(); fail the test with its output if it fails. No time limit by default: a slow,
    loaded machine must not fail a test that would pass. The output goes through files, not pipes (see start)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.run(cmd, cwd=cwd, env=run_env(**(env or {})), stdout=out, stderr=err, timeout=timeout)
        output = written(out) + written(err)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


def written(file) -> str:
    """What a command has written to its output file so far (read without moving the offset it writes at)."""
    text = os.pread(file.fileno(), os.fstat(file.fileno()).st_size, 0).decode(errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as text=True reads a pipe


def start(cmd: list[str], cwd: Path, **popen) -> subprocess.Popen:
    """Start a command in run_env(), its stdout and stderr together in a file: output_of(proc) reads it, and
    proc.wait() returns when the command exits. A pipe would keep a reader waiting until every process holding it had
    exited, the ones the command leaves behind too (srun forks a shepherd that holds srun's output)."""
    output = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=cwd, env=run_env(), stdout=output, stderr=subprocess.STDOUT, **popen)
    proc.output_file = output
    return proc


def output_of(proc: subprocess.Popen) -> str:
    return written(proc.output_file)


def finished(proc: subprocess.Popen) -> str:
    """Wait for a command start() started to exit; its whole output."""
    proc.wait()
    return output_of(proc)


@contextlib.contextmanager
def edited_params(repo: Path, **dotted):
    """params.yaml of a copy edited for the duration of a block, then restored byte for byte."""
    original = (repo / "params.yaml").read_text()
    set_params(repo, **dotted)
    try:
        yield
    finally:
        (repo / "params.yaml").write_text(original)


def set_params(repo: Path, **dotted):
    """Edit params.yaml in a copy, e.g. set_params(repo, **{"eval.prompts": 4})."""
    import yaml

    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for key, value in dotted.items():
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def reproduce_default(dest: Path) -> tuple[Path, str]:
    """A copy of the repository at dest after `dvc repro` on the default (with MGSM from the shared folder),
    committed as "baseline"; the output of dvc repro."""
    repo = copy_repo(dest)
    if MGSM.is_dir():
        set_params(repo, **{"eval.mgsm.path": str(MGSM)})
    output = run(["dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline"], repo)
    return repo, output


class BuiltDefault:
    """One built default pipeline for every worker of a run, in the folder they share: the first to claim it
    builds (or publishes) it, the others wait for it. MLflow's store is left out: it records absolute paths."""

    def __init__(self, tmp_path_factory):
        base = tmp_path_factory.getbasetemp()
        shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        self.path = shared / "default-pipeline"
        self.claimed, self.ready, self.failed = (shared / f"default-pipeline.{name}" for name in
                                                 ("claimed", "ready", "failed"))

    def claim(self) -> bool:
        try:
            claimed = os.open(self.claimed, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(claimed, str(os.getpid()).encode())
        os.close(claimed)
        return True

    @contextlib.contextmanager
    def publishing(self, claimed: bool):
        """A failure in the block, if this worker claimed the build, ends the others' wait with its message."""
        try:
            yield
        except BaseException as error:
            if claimed:
                self.failed.write_text(f"{type(error).__name__}: {error}"[-6000:])
            raise

    def publish(self, repo: Path) -> None:
        # DVC's cache goes along (a few MB): without it every output of a copy is "not in cache", and `dvc repro` of
        # any stage there would run every stage before it again, pretraining the tiny base in fetch included.
        shutil.copytree(repo, self.path, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
        self.ready.touch()

    def wait(self) -> Path:
        """The published pipeline, once it is there; no time limit (a loaded machine builds slowly)."""
        while not self.ready.exists():
            if self.failed.exists():
                pytest.fail(f"the default pipeline failed to build: {self.failed.read_text()}")
            builder = self.claimed.read_text()
            if builder and not psutil.pid_exists(int(builder)) and not self.ready.exists():
                pytest.fail(f"the test worker that built the default pipeline (pid {builder}) died before it was done")
            time.sleep(1)
        return self.path


@pytest.fixture(scope="session")
def repo(tmp_path_factory):
    """A copy of the repository after `dvc repro` on the default (with MGSM from the shared folder); tests run
    experiments in it in turn. Published as default_pipeline, unless another worker's is, before any test runs."""
    built = BuiltDefault(tmp_path_factory)
    claimed = built.claim()
    with built.publishing(claimed):
        repo, output = reproduce_default(tmp_path_factory.mktemp("pipeline") / "repo")
        if claimed:
            built.publish(repo)
    return repo, output


@pytest.fixture(scope="session")
def default_pipeline(tmp_path_factory) -> Path:
    """The default pipeline right after `dvc repro` (no MLflow store), built once per run and never changed: tests
    train or register in a copy of it (pipeline_copy)."""
    built = BuiltDefault(tmp_path_factory)
    if built.claim():
        with built.publishing(True):
            repo, _ = reproduce_default(tmp_path_factory.mktemp("default-pipeline") / "repo")
            built.publish(repo)
    return built.wait()


@pytest.fixture
def pipeline_copy(default_pipeline, tmp_path) -> Path:
    """A copy of the built default pipeline at tmp_path / "repo", for one test to change."""
    return Path(shutil.copytree(default_pipeline, tmp_path / "repo"))


# A short run of the tiny default: few rows, a barely pretrained base, 12 training steps of 8 rows with a checkpoint
# every 2.
SHORT_RUN = {"data.builtin_rows": 300, "model.tiny.pretrain_steps": 10, "train.sft.max_steps": 12,
             "train.sft.per_device_train_batch_size": 8, "train.sft.logging_steps": 1, "train.checkpoint_steps": 2,
             "eval.prompts": 2}
# The outputs of the stages up to merge.
SHORT_RUN_OUTPUTS = ["data/raw", "data/split", "models/base", "models/adapter", "models/merged", "metrics/train.json",
                     "metrics/merge.json", "plots/train_loss.csv"]
# Two pipelines run side by side: their OpenMP threads sleep while they wait instead of spinning, so that neither
# holds a core the other needs (spinning threads slow two trainings on two cores down several times over). Waiting
# does not change what is computed.
SIDE_BY_SIDE = {"OMP_WAIT_POLICY": "PASSIVE"}
# What a one-core CPU without AVX2 would make each library choose: the second clone runs under it, and the pipeline's
# own pins (lora_pipeline.config.cpu_numerics) must still give the first clone's bits.
OTHER_INSTRUCTION_SET = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                         "OMP_NUM_THREADS": "1"}


@dataclass
class ShortRun:
    """A clone after `dvc repro merge` of SHORT_RUN, and what it held right then (tests may change it later)."""
    repo: Path
    md5s: dict  # {output path: md5}, as dvc.lock records them
    files: dict  # {path: bytes} of the adapter, the merged model and the metrics


def output_md5s(repo: Path) -> dict:
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])
            if out["path"] in SHORT_RUN_OUTPUTS}


@pytest.fixture(scope="session")
def short_runs(tmp_path_factory):
    """SHORT_RUN in two clones at different paths, reproduced side by side up to merge (no stage after it reads
    what the tests check), the second under OTHER_INSTRUCTION_SET. The first is reproduced up to split, committed
    ("short run, data ready"), then up to merge: test_resume goes on from that commit; test_reproducible compares
    the two clones' outputs."""
    first = copy_repo(tmp_path_factory.mktemp("short-run") / "repo")
    second = copy_repo(tmp_path_factory.mktemp("second-clone-elsewhere") / "repo")
    for repo in (first, second):
        set_params(repo, **SHORT_RUN)

    def reproduce_first():
        run(["dvc", "repro", "split"], first, env=SIDE_BY_SIDE)
        run(["git", "add", "-A"], first)
        run(["git", "commit", "-qm", "short run, data ready"], first)
        run(["dvc", "repro", "merge"], first, env=SIDE_BY_SIDE)

    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(reproduce_first), pool.submit(run, ["dvc", "repro", "merge"], second,
                                                           env={**SIDE_BY_SIDE, **OTHER_INSTRUCTION_SET})]
        for future in done:
            future.result()
    kept = ["models/adapter/adapter_model.safetensors", "models/adapter/adapter_config.json", "metrics/train.json",
            "models/merged/model.safetensors"]
    return [ShortRun(repo, output_md5s(repo), {path: (repo / path).read_bytes() for path in kept})
            for repo in (first, second)]


SLURM_CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
SLURM_DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "squeue", "scancel", "scontrol")


def free_port_run(count: int, start: int = 16817) -> int:
    """The first of `count` consecutive ports from `start` on that nothing listens on here."""
    def free(port):
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) != 0
    port = start
    while not all(free(port + i) for i in range(count)):
        port += count
    return port


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The two-node Slurm of tests/slurm (nodes n1 and n2 on this machine, one CPU each), started for the tests that
    use it and stopped after them; SLURM_CONF points srun, squeue and scancel (and the pipeline's commands) at it.
    Skipped only where Slurm's packages are not installed (.ci/run installs them); a cluster that does not come up
    fails the tests."""
    missing = [tool for tool in SLURM_DAEMONS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}): tests/slurm/cluster.sh install "
                    "installs Debian's slurmctld, slurmd, slurm-client and munge (as root)")
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "LORA_SLURM_STATE": str(state), "LORA_SLURM_PORT": str(free_port_run(3))}
    started = subprocess.run([str(SLURM_CLUSTER), "start"], env=env, capture_output=True, text=True)
    if started.returncode:
        subprocess.run([str(SLURM_CLUSTER), "stop"], env=env, capture_output=True)
        pytest.fail(f"the test Slurm did not start:\n{started.stdout}{started.stderr}"[-4000:])
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield state
    finally:
        subprocess.run([str(SLURM_CLUSTER), "stop"], env=env, capture_output=True)
        os.environ.pop("SLURM_CONF", None)
