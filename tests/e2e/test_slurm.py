"""The accelerator stages through a real two-node Slurm (tests/slurm: nodes n1 and n2 on this machine, one CPU each),
run by dvc: the adapter of one machine's two processes from two nodes, the evaluation of one process from two nodes,
a refused partition, a cancelled job and a stopped `dvc repro`."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, finished, output_of, run, run_env, set_params, slurm_state, start
from lora_pipeline.launch.ancestors import is_dvc
from lora_pipeline.launch.checkpoints import MANIFEST
from lora_pipeline.launch.launcher import hostnames, main_port

pytestmark = pytest.mark.e2e

# Few steps, rows and prompts: the figures compared do not need more.
SMALL = {"train.sft.max_steps": 6, "train.sft.per_device_train_batch_size": 8, "train.sft.logging_steps": 1,
         "eval.prompts": 2, "eval.max_new_tokens": 48, "eval.mgsm.path": ""}
TWO_NODES = {"launch.launcher": "slurm", "train.accelerate_config": "cpu", "train.nodes": 2}
ADAPTER = ["models/adapter/adapter_model.safetensors", "models/adapter/adapter_config.json", "metrics/train.json"]


@pytest.fixture(scope="module")
def slurm_repo(slurm_cluster, default_pipeline, tmp_path_factory) -> Path:
    """One copy of the built default for every test here, SMALL, committed; the tests run in it in turn."""
    repo = Path(shutil.copytree(default_pipeline, tmp_path_factory.mktemp("slurm-pipeline") / "repo"))
    set_params(repo, **SMALL)
    run(["git", "commit", "-qam", "small"], repo)
    return repo


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(slurm_cluster, slurm_repo):
    """Each test starts on an empty cluster and, whatever its outcome, leaves nothing running: processes it suspended
    are resumed, its dvc runs stopped (their launches cancel their jobs) and any job left cancelled. One job left
    running (two suspended training processes hold both nodes) would keep every later job pending, and the tests
    after it waiting with it."""
    assert wait_until_queue_empty() == [], "jobs an earlier test left behind hold the nodes"
    yield
    ours = processes_in(slurm_repo)
    for process in ours:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.info["status"] == psutil.STATUS_STOPPED:
                process.resume()
    runs = [process for process in ours if is_dvc(process.info["cmdline"] or [])]  # queue workers too
    for process in runs:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    for process in psutil.wait_procs(runs, timeout=60)[1]:  # not ended on SIGTERM: Slurm's cancel below still holds
        process.kill()
    if left := [line.split()[0] for line in queue()]:
        subprocess.run(["scancel", *left], env=run_env())
    assert wait_until_queue_empty() == [], "jobs the test left behind could not be cancelled"


def processes_in(repo: Path) -> list[psutil.Process]:
    """The processes whose working folder is repo, with their command line, status and start time read."""
    where = os.path.realpath(repo)
    return [process for process in psutil.process_iter(["cmdline", "cwd", "status", "create_time"])
            if os.path.realpath(process.info["cwd"] or "/") == where]


def finished_jobs(cluster: Path) -> list[dict]:
    """Slurm's record of each finished job (JobCompType jobcomp/filetxt; the test cluster keeps no accounting
    database for sacct), oldest first."""
    log = cluster / "jobcomp.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines]


def queue() -> list[str]:
    """squeue's jobs: 'id name state nodes' each."""
    listed = subprocess.run(["squeue", "--noheader", "--format=%i %j %T %N"], capture_output=True, text=True,
                            check=True, env=run_env())
    return listed.stdout.splitlines()


def test_a_node_of_a_two_node_step_knows_its_rank_main_node_and_port(slurm_cluster, slurm_repo):
    """What srun tells each node's launcher, read back as the accelerate command that node runs."""
    script = ("from pathlib import Path; from lora_pipeline.launch.launcher import node_command; "
              "from lora_pipeline.config.params import validate; from lora_pipeline.config.dvcfiles import read_yaml; "
              "print(' '.join(node_command('train', validate(read_yaml(Path('params.yaml'))))))")
    set_params(slurm_repo, **TWO_NODES)
    try:
        output = run(["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--label", "python", "-c", script],
                     slurm_repo)
    finally:
        run(["git", "checkout", "params.yaml"], slurm_repo)
    lines = dict(line.split(": ", 1) for line in output.splitlines() if re.match(r"\d+: ", line))
    assert set(lines) == {"0", "1"}, output
    for rank, command in lines.items():
        assert f"--multi_gpu --num_machines 2 --num_processes 2 --machine_rank {rank} --main_process_ip 127.0.0.1" \
            in command, command
        assert "--num_cpu_threads_per_process 1" in command  # one CPU per node here, not this machine's cores
    ports = {re.search(r"--main_process_port (\d+)", command).group(1) for command in lines.values()}
    assert len(ports) == 1, lines  # one rendezvous for both
    assert hostnames("n[1-2]") == ["n1", "n2"]
    assert main_port({"SLURM_JOB_ID": "7"}) != main_port({"SLURM_JOB_ID": "8"})


def test_train_on_two_nodes_gives_the_adapter_of_two_processes_on_one_machine(slurm_cluster, slurm_repo):
    """cpu_ddp here (2 processes, DDP over gloo) and 2 Slurm nodes x 1 process (accelerate multi-node over gloo):
    the same global batch (16 x 2), the same ranks, one thread per process: the same bytes."""
    repo = slurm_repo
    set_params(repo, **{"train.accelerate_config": "cpu_ddp"})
    run(["dvc", "repro", "train"], repo)
    one_machine = {path: (repo / path).read_bytes() for path in ADAPTER}
    before = len(finished_jobs(slurm_cluster))

    set_params(repo, **TWO_NODES)
    output = run(["dvc", "repro", "train"], repo)
    assert "srun --job-name=train --nodes=2 --ntasks=2" in output, output[-3000:]
    jobs = finished_jobs(slurm_cluster)[before:]
    assert [(job["Name"], job["JobState"], job["NodeList"], job["NodeCnt"]) for job in jobs] == \
        [("train", "COMPLETED", "n[1-2]", "2")], jobs
    assert json.loads((repo / "metrics/train.json").read_text())["world_size"] == 2
    two_nodes = {path: (repo / path).read_bytes() for path in ADAPTER}
    assert two_nodes == one_machine
    assert queue() == []
    run(["git", "checkout", "params.yaml"], repo)


def test_exp_run_on_slurm_runs_every_accelerator_stage_there_and_registers(slurm_cluster, slurm_repo):
    """`dvc exp run` with the Slurm params: train, merge, evaluate_base and evaluate run as Slurm jobs named after
    the experiment, register records the model; evaluate over 2 nodes writes what it writes over 1, and a change of
    eval.nodes re-runs the evaluations alone."""
    repo = slurm_repo
    before = len(finished_jobs(slurm_cluster))
    sets = [arg for key, value in {**TWO_NODES, "eval.nodes": 2}.items() for arg in ("-S", f"{key}={value}")]
    run(["dvc", "exp", "run", "-n", "two-nodes", *sets], repo)
    jobs = {job["Name"]: job for job in finished_jobs(slurm_cluster)[before:]}
    for stage, nodes in (("merge", "1"), ("evaluate_base", "2"), ("evaluate", "2")):
        assert jobs[f"two-nodes:{stage}"]["JobState"] == "COMPLETED" and jobs[f"two-nodes:{stage}"]["NodeCnt"] == nodes
    assert (repo / "models/registered.json").is_file()
    assert json.loads((repo / "logs/evaluate.json").read_text())["processes"] == 2  # one group over both nodes
    outputs = ["metrics/eval.json", "metrics/eval_base.json", "reports/generations.jsonl"]
    two_nodes = {path: (repo / path).read_text() for path in outputs}

    output = run(["dvc", "exp", "run", "-n", "one-node", "-S", "eval.nodes=1"], repo)
    for stage in ("train", "merge"):
        assert f"Stage '{stage}' didn't change, skipping" in output
    assert {path: (repo / path).read_text() for path in outputs[2:]} == {p: two_nodes[p] for p in outputs[2:]}
    for path in outputs[:2]:  # held-out loss: float sums over 2 processes may round otherwise in the last bits
        two, one = json.loads(two_nodes[path]), json.loads((repo / path).read_text())
        assert two["test"].pop("loss") == pytest.approx(one["test"].pop("loss"), rel=1e-6)
        assert two["test"].pop("perplexity") == pytest.approx(one["test"].pop("perplexity"), rel=1e-6)
        two.pop("base", None), one.pop("base", None)
        assert two == one
    shown = run(["dvc", "exp", "show", "--csv"], repo)
    assert "two-nodes" in shown and "one-node" in shown
    assert queue() == []


def test_an_unknown_partition_is_refused_before_any_stage_runs(slurm_repo):
    repo = slurm_repo
    before = {path: (repo / path).read_bytes() for path in ADAPTER + ["metrics/eval.json"]}
    set_params(repo, **TWO_NODES, **{"launch.slurm.partition": "nosuch"})
    proc = start(["dvc", "repro"], repo)
    output = finished(proc)
    run(["git", "checkout", "params.yaml"], repo)
    assert proc.returncode != 0
    refusal = next((line for line in output.splitlines() if "launch.slurm.partition" in line), "")
    assert "Slurm refuses train's job (" in refusal and "invalid partition specified: nosuch" in refusal, output
    assert "Running stage 'train'" not in output
    assert {path: (repo / path).read_bytes() for path in before} == before


def test_validate_asks_slurm_whether_it_would_run_each_job(slurm_cluster, monkeypatch):
    """srun --test-only: a job that asks for more nodes than the cluster has, or than are up, is refused with Slurm's
    reason, and the nodes that cannot take it are named with theirs."""
    from helpers import shipped
    from lora_pipeline.validation.all_checks import validate_all
    from lora_pipeline.config.params import ParamsError

    monkeypatch.chdir(ROOT)
    validate_all(shipped(**TWO_NODES, **{"eval.nodes": 2}))
    with pytest.raises(ParamsError, match=r"launch.slurm: Slurm refuses evaluate_base's job \(--nodes=3 .*\): "
                                          r"Requested node configuration is not available"):
        validate_all(shipped(**TWO_NODES, **{"eval.nodes": 3}))
    run(["scontrol", "update", "nodename=n2", "state=drain", "reason=disk failed"], ROOT)
    try:
        with pytest.raises(ParamsError, match=r"launch.slurm: Slurm refuses train's job \(--nodes=2 .*\): Requested "
                                              r"node configuration is not available; nodes that cannot take jobs now: "
                                              r"n2 \(drained: disk failed\)"):
            validate_all(shipped(**TWO_NODES))
        validate_all(shipped(**{"launch.launcher": "slurm"}))  # one node is enough for one
    finally:
        run(["scontrol", "update", "nodename=n2", "state=resume"], ROOT)


def checkpoint_steps(repo: Path) -> list[int]:
    """The steps of the complete checkpoints (each one's manifest is written last)."""
    manifests = (repo / "checkpoints").glob(f"train-*/checkpoint-*/{MANIFEST}")
    return sorted(int(path.parent.name.split("-")[1]) for path in manifests)


def start_train(repo: Path) -> subprocess.Popen:
    return start(["dvc", "repro", "--no-run-cache", "train"], repo)


def suspended_training(repo: Path, proc: subprocess.Popen, ranks: int = 2) -> list[psutil.Process]:
    """The `ranks` training processes that Slurm started in `repo` (slurmstepd's children, not DVC's), suspended
    (SIGSTOP) the moment they are found, so that they advance only in run_training_until's slices; fails if the run
    ends first."""
    since = psutil.Process(proc.pid).create_time()
    while True:
        found = [process for process in processes_in(repo) if process.info["create_time"] >= since
                 and re.fullmatch(r"\S+ (-u )?-m stages\.train", " ".join(process.info["cmdline"] or []))]
        if len(found) == ranks:
            for process in found:
                process.suspend()
            return found
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its {ranks} training processes were seen:\n{output_of(proc)[-3000:]}")
        time.sleep(0.1)


def run_training_until(condition, training: list[psutil.Process], proc: subprocess.Popen, what: str) -> None:
    """Let the suspended training run in slices of 0.2 s until condition() holds, and leave it suspended then:
    however fast a machine trains, a cancel that follows lands within a slice of that moment, long before max_steps.
    A Slurm cancel sends SIGCONT before SIGTERM."""
    while not condition():
        try:
            for process in training:
                process.resume()
            time.sleep(0.2)
            for process in training:
                process.suspend()
        except psutil.NoSuchProcess:
            proc.wait()
            pytest.fail(f"the training ended before {what}:\n{output_of(proc)[-3000:]}")


def wait_until_queue_empty():
    deadline = time.monotonic() + 300  # KillWait (30 s) then SIGKILL bounds it; ten times that for a loaded machine
    while queue() and time.monotonic() < deadline:
        time.sleep(1)
    return queue()


def test_a_cancelled_job_resumes_and_sigterm_of_dvc_leaves_no_job(slurm_cluster, slurm_repo):
    """scancel mid-train: the processes save a checkpoint, the stage fails; the next run resumes from it. SIGTERM
    to `dvc repro` alone (DVC leaves its stage's command running): the launch cancels its job, squeue is empty after,
    and the run after resumes and ends at max_steps."""
    repo, steps = slurm_repo, 12  # checkpoints every 2 steps: room for the cancel, the SIGTERM and the run to the end
    set_params(repo, **TWO_NODES, **{"train.sft.max_steps": steps, "train.checkpoint_steps": 2, "lora.r": 4})
    proc = start_train(repo)
    training = suspended_training(repo, proc)
    run_training_until(lambda: checkpoint_steps(repo), training, proc, "a checkpoint")
    job = next(line.split()[0] for line in queue() if line.split()[1] == "train")
    subprocess.run(["scancel", job], check=True, env=run_env())
    output = finished(proc)
    assert proc.returncode != 0, output[-3000:]
    assert wait_until_queue_empty() == []
    assert finished_jobs(slurm_cluster)[-1]["JobState"] == "CANCELLED"
    cancelled_at = checkpoint_steps(repo)[-1]

    proc = start_train(repo)
    training = suspended_training(repo, proc)
    run_training_until(lambda: checkpoint_steps(repo)[-1] > cancelled_at, training, proc, "a checkpoint past the first")
    proc.send_signal(signal.SIGTERM)  # to DVC alone
    output = finished(proc)
    assert "resuming from checkpoints/train-" in output
    assert wait_until_queue_empty() == [], "the Slurm job outlived the dvc run that started it"
    assert finished_jobs(slurm_cluster)[-1]["JobState"] == "CANCELLED"  # by the launch, before training ended
    stopped_at = checkpoint_steps(repo)[-1]
    assert stopped_at > cancelled_at

    output = run(["dvc", "repro", "--no-run-cache", "train"], repo)
    assert f"checkpoint-{stopped_at}" in output and "resuming from" in output
    assert json.loads((repo / "metrics/train.json").read_text())["steps"] == steps
    run(["git", "checkout", "params.yaml", "dvc.lock"], repo)


def training_on(node: str, training: list[psutil.Process]) -> psutil.Process:
    """The training process that Slurm started on `node` (SLURMD_NODENAME in its environment)."""
    return next(process for process in training if process.environ().get("SLURMD_NODENAME") == node)


def stop_step(output: str) -> int:
    """The step that a stop line of the training's own names (`train stopped by SIGUSR1 (signal 10) at step 52`)."""
    return int(re.findall(r"train stopped by SIG\w+ \(signal \d+\) at step (\d+)", output)[-1])


def test_a_lost_node_ends_in_one_line_and_a_job_at_its_time_limit_keeps_the_step_it_reached(slurm_cluster, slurm_repo):
    """SIGKILL to node n2's training process (a lost node, an out-of-memory kill): one line names the node, the task
    and the signal, no traceback of the rank stopped because of it reaches the terminal, the checkpoint is kept. The
    next run resumes from it until Slurm's signal ahead of the time limit (launch.slurm.time 2, save_before_limit
    60): every process saves the step it is at and the stage ends in one line; the run after resumes from that step."""
    repo = slurm_repo
    shutil.rmtree(repo / "checkpoints", ignore_errors=True)  # an earlier test's stopped run: not this one's checkpoint
    set_params(repo, **TWO_NODES, **{"train.sft.max_steps": 100000, "train.checkpoint_steps": 10, "lora.r": 6,
                                     "launch.slurm.time": "2", "launch.slurm.save_before_limit": 60})
    proc = start_train(repo)
    training = suspended_training(repo, proc)
    run_training_until(lambda: checkpoint_steps(repo), training, proc, "a checkpoint")
    training_on("n2", training).kill()
    for process in training:
        process.resume()
    output = finished(proc)
    assert proc.returncode != 0
    kept = checkpoint_steps(repo)[-1]
    lines = [line for line in output.splitlines() if line.startswith("train: ")]
    assert lines[1:] == [f"train: task 1 on node n2 failed first: its train process ended by SIGKILL (signal 9); "
                         f"Slurm ended the job's other tasks; kept: checkpoint {checkpoint_dir(repo, kept)} (step "
                         f"{kept}); `dvc repro` resumes from it (every node's output: logs/slurm-train.log)"], output
    assert "Traceback" not in output and "stopped by" not in output, output[-3000:]
    assert "Traceback" in (repo / "logs/slurm-train.log").read_text()  # rank 0's lost connection: in the log
    assert wait_until_queue_empty() == []

    resumed_from = checkpoint_dir(repo, kept)  # set aside once newer ones are saved
    proc = start_train(repo)  # resumes, then Slurm's SIGUSR1 a minute ahead of the limit
    output = finished(proc)
    assert proc.returncode != 0 and f"resuming from {resumed_from}" in output, output[-3000:]
    saved = stop_step((repo / "logs/slurm-train.log").read_text())
    assert saved > kept and checkpoint_steps(repo)[-1] == saved
    assert "train: the Slurm job reached its time limit (launch.slurm.time 2)" in output
    assert f"kept: checkpoint {checkpoint_dir(repo, saved)} (step {saved}); `dvc repro` resumes" in output
    assert "Traceback" not in output
    assert wait_until_queue_empty() == []

    proc = start_train(repo)
    while f"resuming from {checkpoint_dir(repo, saved)}" not in output_of(proc):
        assert proc.poll() is None, output_of(proc)[-3000:]
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)  # to DVC alone: the launch cancels the job
    finished(proc)
    run(["git", "checkout", "params.yaml", "dvc.lock"], repo)


def checkpoint_dir(repo: Path, step: int) -> Path:
    """The checkpoint of `step`, as the stage names it (relative to the repository)."""
    return next(repo.glob(f"checkpoints/train-*/checkpoint-{step}")).relative_to(repo)


def test_a_preempted_job_is_submitted_again_and_resumes_in_the_same_stage_run(slurm_cluster, slurm_repo):
    """A job of the urgent partition preempts the training's (the test cluster's PreemptMode REQUEUE: Slurm requeues
    batch jobs only, and srun's job is cancelled): the processes save on SIGTERM within the grace time, the launch
    says so in a line, submits the job again, and it resumes from that checkpoint and trains to the end, all in one
    `dvc repro`."""
    repo, steps = slurm_repo, 40
    shutil.rmtree(repo / "checkpoints", ignore_errors=True)  # an earlier test's stopped run: not this one's checkpoint
    set_params(repo, **TWO_NODES, **{"train.sft.max_steps": steps, "train.checkpoint_steps": 10, "lora.r": 5})
    proc = start_train(repo)
    training = suspended_training(repo, proc)
    run_training_until(lambda: checkpoint_steps(repo), training, proc, "a checkpoint")
    urgent = start(["srun", "--partition=urgent", "--nodes=2", "--job-name=urgent", "true"], repo)
    while not any(line.split()[1] == "urgent" for line in queue()):
        time.sleep(0.2)
    # Left suspended: Slurm's preemption wakes them (SIGCONT, then SIGTERM) when its scheduler next runs; resumed
    # earlier, a fast machine would train to the end before it
    _, alive = psutil.wait_procs(training, timeout=300)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.resume()
    output = finished(proc)
    assert proc.returncode == 0 and finished(urgent) is not None and urgent.returncode == 0, output[-3000:]
    resumed = re.search(r"train: Slurm preempted the job; kept: checkpoint (\S+); it resumes from there; submitted "
                        r"again", output)
    assert resumed, output[-3000:]
    assert f"resuming from {resumed.group(1)}" in output
    assert json.loads((repo / "metrics/train.json").read_text())["steps"] == steps
    assert "Traceback" not in output
    preempted, *after = [(job["Name"], job["JobState"]) for job in finished_jobs(slurm_cluster)[-3:]]
    assert preempted[0] == "train" and preempted[1] != "COMPLETED" and after == [("urgent", "COMPLETED"),
                                                                                ("train", "COMPLETED")], after
    run(["git", "checkout", "params.yaml", "dvc.lock"], repo)


def test_two_queued_experiments_run_as_two_slurm_jobs_at_once_and_both_register(slurm_cluster, slurm_repo):
    """`dvc exp run --queue` twice, `dvc queue start -j 2`: each experiment's stages are Slurm jobs named after it,
    one node each, so the two run side by side; both are registered in the workspace's MLflow store."""
    import mlflow

    repo = slurm_repo
    run(["git", "checkout", "params.yaml", "dvc.lock"], repo)
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    versions_before = len(client.search_model_versions("name='lora-pipeline'"))
    names = {"sweep-r4": 4, "sweep-r16": 16}
    for name, rank in names.items():
        run(["dvc", "exp", "run", "--queue", "-n", name, "-S", "launch.launcher=slurm", "-S", f"lora.r={rank}",
             "-S", "eval.include_base=false"], repo)  # evaluate_base then loads no model
    together, done = [], threading.Event()

    def watch():  # squeue twice a second: which experiments have a job running at once
        while not done.is_set():
            running = {line.split()[1].split(":")[0] for line in queue() if line.split()[2] == "RUNNING"}
            if set(names) <= running:
                together.append(running)
            time.sleep(0.5)

    watching = threading.Thread(target=watch)
    watching.start()
    run(["dvc", "queue", "start", "-j", "2"], repo)
    try:
        stuck = []
        while re.search(r"\b(Queued|Running)\b", status := run(["dvc", "queue", "status"], repo)):
            stuck = stuck[-1:] + [why_the_sweep_cannot_end(repo)]
            if all(stuck) and len(stuck) == 2:  # twice in a row: a worker between tasks is not taken for a lost one
                pytest.fail(f"{stuck[-1]}\n{status}\n{sweep_diagnostics(repo, names)}")
            time.sleep(5)  # each `dvc queue status` costs a second or more of a core the experiments need
    finally:
        done.set()
        watching.join()
        run(["dvc", "queue", "stop"], repo)
    assert all(re.search(rf"\b{name}\b.*\bSuccess\b", status) for name in names), status
    assert together, "the two experiments' jobs never ran at once"
    jobs = [job["Name"] for job in finished_jobs(slurm_cluster)]
    for name in names:
        assert {f"{name}:{stage}" for stage in ("train", "merge", "evaluate")} <= set(jobs), jobs
    assert len(client.search_model_versions("name='lora-pipeline'")) == versions_before + 2
    assert queue() == []


def queue_workers(repo: Path) -> list[psutil.Process]:
    """The DVC queue's worker processes for repo (`dvc exp queue-worker ...`, run in the repository's folder)."""
    return [process for process in processes_in(repo) if "queue-worker" in (process.info["cmdline"] or [])]


def why_the_sweep_cannot_end(repo: Path) -> str:
    """Why queued experiments cannot finish, read from the state of DVC's queue and of Slurm: '' while they can."""
    if not queue_workers(repo):
        return "the DVC queue has no worker left, and experiments are still queued or running"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %E"], capture_output=True, text=True, env=run_env())
    unusable = [line for line in nodes.stdout.splitlines() if re.search(r" (drain|drng|down|fail)\S* ", line + " ")]
    return f"Slurm cannot run the sweep's jobs on these nodes: {unusable}" if unusable else ""


def sweep_diagnostics(repo: Path, names) -> str:
    """What to read when a sweep cannot end: Slurm's jobs and nodes, the queue's worker logs, each experiment's log."""
    shown = slurm_state()
    for log in sorted((repo / ".dvc" / "tmp" / "exps" / "celery").glob("*.out")):
        shown.append(f"$ tail {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    for name in names:
        logs = subprocess.run(["dvc", "queue", "logs", name], cwd=repo, capture_output=True, text=True, env=run_env())
        shown.append(f"$ dvc queue logs {name}\n{(logs.stdout + logs.stderr)[-1500:]}")
    return "\n".join(shown)
