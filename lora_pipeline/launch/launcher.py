"""How train, merge, evaluate_base and evaluate start (each one's dvc.yaml cmd): on this machine through `accelerate
launch` or python (launch.launcher local), or as a Slurm job through srun, one accelerate launcher per node
(launch.launcher slurm).

    python -m lora_pipeline.launch <stage>
With slurm, from a login node srun asks for train.nodes / eval.nodes nodes and blocks until the job ends; inside an
allocation (salloc, sbatch: SLURM_JOB_ID set) it runs a step of that allocation. On each node srun starts this module
again with --on-node, which reads the machine rank, the main node and a port from Slurm's variables and starts that
node's accelerate launcher. SIGINT, SIGTERM, SIGHUP, or the end of the DVC process that ran it (or of the shell
between), cancels the job (scancel: the processes get SIGTERM, so train saves a checkpoint) and waits for it to end.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lora_pipeline.config.params import load_params
from lora_pipeline.launch import stage_launch
from lora_pipeline.launch.ancestors import any_gone, dvc_ancestors
from lora_pipeline.launch.checkpoints import kept_checkpoint, stop_line
from lora_pipeline.launch.machine import accelerate_config, on_slurm, processes_here, starts_one_process
from lora_pipeline.launch.slurm_step import TIME_LIMIT_SIGNAL, StepOutput

# stage -> (the module it runs with its arguments, the params section naming its accelerate config and node count;
# None: one process, on one node)
STAGES = {
    "train": (["stages.train"], "train"),
    "merge": (["stages.merge"], None),
    "evaluate_base": (["stages.evaluate", "base"], "eval"),
    "evaluate": (["stages.evaluate"], "eval"),
}
CONFIGS = Path("configs/accelerate")
LOGS = Path("logs")  # each Slurm job's whole output, every node's lines: logs/slurm-<stage>.log
USABLE_STATES = {"idle", "mixed", "allocated", "completing", "planned"}  # sinfo's long states of a node that runs jobs
# Stages that run in the launcher's interpreter when their config starts one process on this machine (stage_launch
# .run_here). train keeps accelerate's launcher: a SIGTERM to it saves a checkpoint that the launcher reports.
IN_LAUNCHER = {"evaluate_base", "evaluate"}


class LaunchError(RuntimeError):
    """Slurm refused the job, or a node cannot tell its place in it."""


def local_command(stage: str, params) -> list[str]:
    """The command that runs the stage on this machine: what dvc.yaml ran before Slurm (accelerate launch with the
    section's config, or python for a one-process stage)."""
    module, section = STAGES[stage]
    if section is None:
        return [sys.executable, "-m", *module]
    config = getattr(params, section).accelerate_config
    return ["accelerate", "launch", "--config_file", str(CONFIGS / f"{config}.yaml"), "-m", *module]


def in_launcher_config(stage: str, params, command: list[str]) -> dict | None:
    """The accelerate config of a stage that runs in this interpreter (stage_launch.run_here), or None: an IN_LAUNCHER
    stage whose config starts one process, launched as on this machine alone (on a Slurm node, the launch may join
    other nodes' processes or take the node's CPUs: it keeps accelerate's launcher)."""
    if stage not in IN_LAUNCHER or command != local_command(stage, params):
        return None
    config = accelerate_config(getattr(params, STAGES[stage][1]))
    return config if starts_one_process(config) else None


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list (n[1-2]) as host names, by Slurm's own expansion."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                          text=True).stdout.split()


def node_address(host: str) -> str:
    """The address Slurm reaches a node at (its NodeAddr; the host name where scontrol does not say)."""
    shown = subprocess.run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True).stdout
    found = re.search(r"\bNodeAddr=(\S+)", shown)
    return found.group(1) if found else host


def main_port(environ) -> int:
    """A port for the processes' rendezvous, the same on every node of a step: from the job and step ids, so that
    jobs running side by side (whose ids differ) do not meet on one port."""
    job, step = int(environ["SLURM_JOB_ID"]), int(environ.get("SLURM_STEP_ID", "0") or 0)
    return 20000 + (job % 4000) * 10 + step % 10


def node_command(stage: str, params, environ=os.environ) -> list[str]:
    """On one node of a Slurm step: its accelerate launcher, told the machines, its own rank among them, the main node's
    address and port; CPU processes get the CPUs Slurm gave this node, shared among them."""
    command = local_command(stage, params)
    _, section = STAGES[stage]
    if section is None:
        return command
    settings = getattr(params, section)
    config = accelerate_config(settings)
    per_node, nodes = processes_here(config), settings.nodes
    extra = []
    if config.get("use_cpu"):  # accelerate would count this machine's cores, not the ones Slurm allocated
        cpus = int(environ.get("SLURM_CPUS_ON_NODE", "1"))
        extra += ["--num_cpu_threads_per_process", str(max(cpus // per_node, 1))]
    if nodes > 1:
        hosts = hostnames(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
        name = environ.get("SLURMD_NODENAME", "")
        rank = hosts.index(name) if name in hosts else int(environ["SLURM_NODEID"])
        if config.get("distributed_type", "NO") == "NO":  # one process per node: many, once nodes are counted
            extra.append("--multi_gpu")
        extra += ["--num_machines", str(nodes), "--num_processes", str(nodes * per_node), "--machine_rank", str(rank),
                  "--main_process_ip", node_address(hosts[0]), "--main_process_port", str(main_port(environ))]
    at = command.index("-m")
    return command[:at] + extra + command[at:]


def job_name(stage: str, environ=os.environ) -> str:
    """The Slurm job's name: the DVC experiment and the stage (squeue lists it), or the stage outside an experiment."""
    experiment = environ.get("DVC_EXP_NAME")
    return f"{experiment}:{stage}" if experiment else stage


def srun_command(stage: str, params, environ=os.environ) -> list[str]:
    """srun for the stage: one task (an accelerate launcher) per node. launch.slurm's settings pass to Slurm as they
    are; partition, account and time limit only from a login node (a step lives in its allocation's)."""
    _, section = STAGES[stage]
    nodes = getattr(params, section).nodes if section else 1
    slurm = params.launch.slurm
    command = ["srun", f"--job-name={job_name(stage, environ)}", f"--nodes={nodes}", f"--ntasks={nodes}",
               "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
    if not environ.get("SLURM_JOB_ID"):
        command += [f"--{key}={value}" for key, value in
                    (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time)) if value]
        if slurm.time and slurm.save_before_limit:  # every process, that long before the limit: save and stop
            command.append(f"--signal={TIME_LIMIT_SIGNAL.name.removeprefix('SIG')}@{slurm.save_before_limit}")
    gpus = min(slurm.gpus_per_node, 1) if section is None else slurm.gpus_per_node  # merge: one process, one GPU
    if gpus:
        command.append(f"--gpus-per-node={gpus}")
    if slurm.cpus_per_task:
        command.append(f"--cpus-per-task={slurm.cpus_per_task}")
    return command + [sys.executable, "-m", "lora_pipeline.launch", "--on-node", stage]


def slurm_refusal(command: list[str]) -> str | None:
    """Slurm's reason for refusing the job of an srun command, asked without running it (srun --test-only), or None."""
    tested = subprocess.run([command[0], "--test-only", *command[1:command.index(sys.executable)], "true"],
                            capture_output=True, text=True)
    if tested.returncode == 0:
        return None
    lines = [line.strip() for line in (tested.stderr + tested.stdout).splitlines() if line.strip()]
    said = [line.removeprefix("srun: error: ") for line in lines if line.startswith("srun: error: ")] or lines[-1:]
    return said[0].removeprefix("allocation failure: ") if said else f"srun exited {tested.returncode}"


def unavailable_nodes(partition: str = "") -> list[str]:
    """The nodes (of the partition, or every one) that cannot take a job now, each with its state and Slurm's reason:
    e.g. 'n2 (drained: disk failed)'. A trailing * in sinfo's state: the node does not answer."""
    listed = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%E",
                             *([f"--partition={partition}"] if partition else [])], capture_output=True, text=True)
    found = {}
    for line in listed.stdout.splitlines():
        node, state, reason = (line.split("|", 2) + ["", ""])[:3]
        if state.endswith("*") or state.rstrip("~#!%$@^-") not in USABLE_STATES:
            said = state.rstrip("*") + (" and not responding" if state.endswith("*") else "")
            found[node] = f"{node} ({said}" + (f": {reason})" if reason and reason != "none" else ")")
    return list(found.values())


def check_launch(params, root: Path = Path(".")) -> None:
    """What the launch params cannot start, before any stage runs: several nodes on this machine alone, Slurm without
    its srun, a job Slurm refuses (an unknown partition, more nodes than there are or than are up, GPUs the nodes lack:
    asked with srun --test-only from a login node, naming the nodes that are down or drained and why), and more GPUs
    per node than the accelerate configs start processes per node."""
    problems = []
    for key in ("train", "eval"):
        if getattr(params, key).nodes > 1 and not on_slurm(params.launch):
            problems.append(f"{key}.nodes: {getattr(params, key).nodes} nodes need launch.launcher slurm (the local "
                            "launcher starts processes on this machine only); allowed with local: 1")
    if on_slurm(params.launch):
        slurm = params.launch.slurm
        for key in ("train", "eval"):
            section = getattr(params, key)
            per_node = processes_here(accelerate_config(section, root))
            if slurm.gpus_per_node > per_node:
                problems.append(f"launch.slurm.gpus_per_node: {slurm.gpus_per_node} GPUs per node, but "
                                f"{key}.accelerate_config {section.accelerate_config} starts {per_node} "
                                f"process{'es' * (per_node != 1)} per node, one per GPU; allowed: at most {per_node}, "
                                "or a config that starts as many processes per node as GPUs")
        limit = slurm_seconds(slurm.time) if slurm.time else None
        if limit is not None and slurm.save_before_limit >= limit:
            problems.append(f"launch.slurm.save_before_limit: {slurm.save_before_limit} s is not less than "
                            f"launch.slurm.time {slurm.time} ({limit} s): the processes would be told to save before "
                            f"they start; allowed: 0 (no signal) to {limit - 1}, or a longer launch.slurm.time")
        if shutil.which("srun") is None:
            problems.append("launch.launcher: slurm starts jobs with srun, which is not on PATH here; install Slurm's "
                            "client (slurm-client) or run where it is, or use launch.launcher local")
        elif not os.environ.get("SLURM_JOB_ID"):  # inside an allocation the steps take what it holds
            asked = {}
            for stage in STAGES:
                asked.setdefault(tuple(srun_command(stage, params, {})), stage)
            for command, stage in asked.items():
                if reason := slurm_refusal(list(command)):
                    key = "launch.slurm.partition" if "partition" in reason.lower() else "launch.slurm"
                    options = srun_settings(list(command[:command.index(sys.executable)]))
                    down = unavailable_nodes(slurm.partition)
                    reason += f"; nodes that cannot take jobs now: {', '.join(down)}" if down else ""
                    problems.append(f"{key}: Slurm refuses {stage}'s job ({options}): {reason}")
                    break  # one job's reason says it; the others would repeat it
    if problems:
        raise ValueError("\n".join(problems))


def our_jobs(name: str, environ=os.environ) -> list[str]:
    """The Slurm job (or, inside an allocation, the step) this launch started: found by its name among this user's."""
    if environ.get("SLURM_JOB_ID"):
        listed = ["squeue", "--noheader", "--steps", f"--jobs={environ['SLURM_JOB_ID']}", "--format=%i %j"]
    else:
        listed = ["squeue", "--noheader", "--me", "--format=%i %j"]
    rows = subprocess.run(listed, capture_output=True, text=True).stdout.splitlines()
    return [row.split(" ", 1)[0] for row in rows if row.split(" ", 1)[1:] == [name]]


def run_srun(command: list[str], name: str, stage: str, log: Path) -> tuple[int, StepOutput | None]:
    """Run srun in its own session (a terminal's Ctrl-C reaches this process alone: srun would only print its status)
    and relay its output, every line to `log` and, until the first sign of a fault, to the terminal (StepOutput); on a
    signal, cancel the job through Slurm and wait for srun to end. Returns srun's exit code (128 + the signal this
    process got, if one did) and, for a job that failed by itself, what its output said (its verdict names how it
    ended). Raises LaunchError with Slurm's reason when it refuses the job."""
    dvc = dvc_ancestors()
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, encoding="utf-8", errors="replace", bufsize=1)  # srun may cut a character
    refused, output = [], StepOutput(stage)
    log.parent.mkdir(parents=True, exist_ok=True)

    def relay():
        with open(log, "a", encoding="utf-8") as written:
            for line in proc.stdout:
                written.write(line)
                shown = output.feed(line.rstrip("\n"))
                try:
                    if shown is not None:
                        sys.stdout.write(shown + "\n")
                        sys.stdout.flush()
                except OSError:  # the reader (DVC) is gone: keep draining srun's output so that it never blocks
                    pass
                if found := re.match(r"srun: error: Unable to allocate resources: (.*)", line):
                    refused.append(found.group(1).strip())

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    received = []

    def cancel(signum, _frame):
        received.append(signum)
        output.faulted = True  # what the stopped processes print next is for the log
        jobs = our_jobs(name)
        if jobs:  # scancel: SIGTERM to every process of the job, SIGKILL after Slurm's KillWait
            subprocess.run(["scancel", *jobs], capture_output=True)
        else:  # not allocated yet: srun withdraws its request
            proc.send_signal(signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, cancel)
    while True:
        try:
            returncode = proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            if not received and any_gone(dvc):
                cancel(signal.SIGTERM, None)
    relaying.join(timeout=10)  # srun has ended; its shepherd (a fork that holds the same stdout) may outlive it
    if received:
        return 128 + received[0], None
    if returncode and refused:
        raise LaunchError(f"Slurm refused the job: {refused[-1]} (launch.slurm: {srun_settings(command)})")
    if not returncode:
        return 0, None
    if output.cancelled and was_preempted(output.cancelled[0]):  # a grace time's cancel names no reason
        output.cancelled_because("PREEMPTION")
    for line in output.shown_after():  # the failing task's own error
        print(line, flush=True)
    return returncode, output


def was_preempted(job: str) -> bool:
    """Whether Slurm preempted the job, as it keeps it for a while after it ends (MinJobAge): in state PREEMPTED, or,
    where its processes ended within the partition's grace time, with the time it was preempted at."""
    shown = subprocess.run(["scontrol", "show", "job", job, "--oneliner"], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"\b(JobState|PreemptTime)=(\S+)", shown))
    return fields.get("JobState") == "PREEMPTED" or fields.get("PreemptTime", "None") not in ("None", "Unknown")


def srun_settings(command: list[str]) -> str:
    """The options of an srun command that say what the job asks for (not how the launcher runs it)."""
    return " ".join(arg for arg in command[1:] if arg.startswith("--")
                    and not arg.startswith(("--job-name", "--kill-on-bad-exit", "--label"))) or "none"


def slurm_seconds(limit: str) -> int | None:
    """A Slurm time limit in seconds (minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds); None for no limit or one not written so."""
    days, _, rest = limit.rpartition("-") if "-" in limit else ("0", "", limit)
    parts = rest.split(":")
    if not (days.isdigit() and all(part.isdigit() for part in parts)) or len(parts) > 3:
        return None
    numbers = [int(part) for part in parts]
    if "-" in limit:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (numbers + [0, 0])[:3]
    elif len(numbers) == 3:
        hours, minutes, seconds = numbers
    else:  # minutes[:seconds]
        hours, minutes, seconds = 0, numbers[0], numbers[1] if len(numbers) == 2 else 0
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def run_on_slurm(stage: str, params) -> int:
    """The stage as a Slurm job (srun, one task a node), submitted again after a preemption; its exit code. A job
    that fails or is stopped ends in one line: what happened first, the checkpoint kept, the way on."""
    command = srun_command(stage, params)
    print(f"{stage}: {' '.join(command)}", flush=True)
    started, log = time.time(), LOGS / f"slurm-{stage}.log"
    log.unlink(missing_ok=True)
    while True:
        try:
            returncode, failed = run_srun(command, job_name(stage), stage, log)
        except LaunchError as exc:
            raise SystemExit(f"{stage}: {exc}") from None
        kept = kept_checkpoint(started)
        if not (failed and failed.preempted):
            break
        print("\n" + failed.resubmitted(kept), file=sys.stderr, flush=True)
    if failed:
        line = failed.verdict(kept, params.launch.slurm.time) + f" (every node's output: {log})"
        print("\n" + line, file=sys.stderr, flush=True)
    elif returncode > 128:  # cancelled on a signal to this process: the job's processes got SIGTERM
        print("\n" + stop_line(stage, returncode - 128, kept), file=sys.stderr, flush=True)
    return returncode


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    on_node = args[:1] == ["--on-node"]
    args = args[1:] if on_node else args
    if len(args) != 1 or args[0] not in STAGES:
        raise SystemExit(f"usage: python -m lora_pipeline.launch [--on-node] <stage>; stages: {', '.join(STAGES)}")
    stage = args[0]
    params = load_params(stage)
    if on_node:
        command = node_command(stage, params)
    elif params.launch.launcher == "local":
        command = local_command(stage, params)
    else:
        sys.exit(run_on_slurm(stage, params))
    if command[:2] == ["accelerate", "launch"]:  # accelerate in this process: a stop by a signal ends in one line
        if (config := in_launcher_config(stage, params, command)) is not None:
            stage_launch.run_here(command[2:], stage, bool(config.get("use_cpu")))
        else:
            stage_launch.main(command[2:], stage)
        return
    os.execvp(command[0], command)  # a one-process stage: this process becomes it, signals reach it as before


if __name__ == "__main__":
    main()
