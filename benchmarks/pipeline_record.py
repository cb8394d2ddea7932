"""Run a pipeline's stages one by one in dvc.yaml's order, timing each: one JSON line per stage, then a table.
With --exp, one `dvc exp run -S ...` after the pipeline instead, each stage it ran timed from DVC's own lines."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lora_pipeline.config.dvcfiles import stage, stages

# dvc repro's lines for a stage it did not run
NOT_RUN = r"(?:didn't change, skipping|is cached - skipping run)"
SKIPPED = re.compile(NOT_RUN)
# the lines of `dvc exp run` (and repro) that start a stage, pass over one, and end the one that ran
RUNNING = re.compile(r"^Running stage '([^']+)'")
PASSED_OVER = re.compile(rf"^Stage '([^']+)' {NOT_RUN}")
LOCKED = re.compile(r"^Updating lock file")
# what the copy may hold untracked when git is set up in it for `dvc exp run`: more is an output git does not ignore
LARGEST_COMMITTED_BYTES = 50 * 2**20
LOG_TAIL_LINES = 30


def stage_names(repo: Path) -> list[str]:
    """dvc.yaml's stages in the order written (the pipeline's order)."""
    return list(stages(repo))


def stage_cmd(name: str, repo: Path) -> str:
    """The stage's command with `${...}` resolved from params.yaml by DVC's own interpolation."""
    cmd = stage(name, repo)["cmd"]
    return cmd if isinstance(cmd, str) else " && ".join(cmd)


class GpuMemory:
    """The highest memory.used of any GPU, sampled every `interval` s by one `nvidia-smi -lms` while it runs; the
    samples, with their times, give the peak within a part of the run."""

    def __init__(self, interval: float = 0.5):
        self.peak_mib = None
        self.samples: list[tuple[float, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          f"-lms={int(interval * 1000)}"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                used = float(line.strip())
            except ValueError:
                continue
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            self.samples.append((time.time(), used))

    def stop(self) -> float | None:
        """Stop sampling; the peak in GiB (None without nvidia-smi or a sample)."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=2)
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)

    def peak_between(self, start: float, end: float) -> float | None:
        """The peak in GiB of the samples taken between two `time.time()`s (None without one)."""
        used = [mib for at, mib in self.samples if start <= at <= end]
        return round(max(used) / 1024, 2) if used else None


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len([d for d in visible.split(",") if d.strip()])) if visible is not None else count


def stage_figures(repo: Path, stage: str, since: float, until: float = float("inf")) -> dict:
    """The JSON files under logs/ whose name starts with the stage's and that the stage wrote (between `since` and
    `until`)."""
    figures = {}
    for path in sorted((repo / "logs").glob(f"{stage}*.json")):
        if since <= path.stat().st_mtime <= until:
            try:
                figures[path.name] = json.loads(path.read_text())
            except ValueError:
                figures[path.name] = None
    return figures


class Runner:
    """Runs stages as child process groups; a SIGTERM or SIGINT stops the one running and records it."""

    def __init__(self, repo: Path, logs: Path, echo: bool = True):
        self.repo, self.logs, self.echo = repo, logs, echo
        self.child = None
        self.stopped = None

    def run(self, command: list[str] | str, log: Path, on_line=None) -> tuple[int, str]:
        """(exit status, the last lines of its output); the output goes to `log` and, with echo, to stdout;
        `on_line(line, time.time())` sees each line as it comes."""
        log.parent.mkdir(parents=True, exist_ok=True)
        tail = []
        with log.open("w") as out:
            self.child = subprocess.Popen(command, cwd=self.repo, shell=isinstance(command, str),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          errors="replace", start_new_session=True)
            for line in self.child.stdout:
                out.write(line)
                if on_line is not None:
                    on_line(line.rstrip("\n"), time.time())
                tail = (tail + [line.rstrip("\n")])[-LOG_TAIL_LINES:]
                if self.echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            status = self.child.wait()
        self.child = None
        return (-self.stopped if self.stopped else status), "\n".join(tail)

    @contextlib.contextmanager
    def stopping_on_signals(self):
        """While inside, a SIGTERM or SIGINT stops the command running (stop) instead of this process."""
        previous = {s: signal.signal(s, self.stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def stop(self, signum, _frame):
        self.stopped = signum
        if self.child is not None:
            try:
                os.killpg(self.child.pid, signal.SIGTERM)  # the stage and everything it started
            except ProcessLookupError:
                pass


def row_of(recipe: str, stage: str, seconds: float, peak_gib: float | None, gpus: int, commit: str, ran: str,
           command: str, status: int, note: str = "") -> dict:
    """A row of the output file: what ran, how long, at which commit."""
    return {"recipe": recipe, "stage": stage, "seconds": seconds, "peak_gib": peak_gib, "gpus": gpus, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "ran": ran,
            "command": command, "status": status, **({"note": note} if note else {})}


def run_pipeline(repo: Path, recipe: str, out: Path, commit: str, only: list[str] = (), force: bool = False,
                 use_dvc: bool = True, echo: bool = True, note: str = "") -> list[dict]:
    """Each stage (all of dvc.yaml's, or `only`) through `dvc repro -s` (or its cmd); a row per stage run appended
    to `out`. Stops at the first failing stage. Returns the rows, with those dvc skipped marked `skipped`."""
    names = stage_names(repo)
    unknown = [name for name in only if name not in names]
    if unknown:
        raise SystemExit(f"pipeline: no stage {', '.join(unknown)} in {repo}/dvc.yaml; stages: {', '.join(names)}")
    runner = Runner(repo, repo.parent / "logs", echo)
    gpus = gpu_count()
    rows = []
    with runner.stopping_on_signals():
        for name in [n for n in names if not only or n in only]:
            if use_dvc:
                command = [sys.executable, "-m", "dvc", "repro", "-s", *(["-f"] if force else []), name]
                how, shown = "dvc repro -s", f"dvc repro -s {'-f ' if force else ''}{name}"
            else:
                command = shown = stage_cmd(name, repo)
                how = "cmd"
            print(f"=== {name}: {shown} ({time.strftime('%H:%M:%S')})", flush=True)
            began, wall = time.time(), time.perf_counter()
            memory = GpuMemory()
            status, tail = runner.run(command, runner.logs / f"{name}.log")
            seconds = round(time.perf_counter() - wall, 1)
            row = row_of(recipe, name, seconds, memory.stop(), gpus, commit, how, shown, status, note)
            if status == 0 and use_dvc and SKIPPED.search(tail):
                rows.append({**row, "skipped": True})
                continue
            figures = stage_figures(repo, name, began)
            if figures:
                row["figures"] = figures
            if status != 0:
                row["log_tail"] = tail
            rows.append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if status != 0:
                print(f"pipeline: stage {name} exited {status}; its log: {runner.logs / f'{name}.log'}",
                      file=sys.stderr)
                break
    return rows


def stage_spans(lines: list[tuple[float, str]], end: float) -> list[dict]:
    """The stages a `dvc exp run` (or `dvc repro`) ran, from its output lines and their times: each from its
    `Running stage` line to DVC's lock file update after it (else the next stage's line, else `end`)."""
    spans, current = [], None
    for at, line in lines:
        started = RUNNING.match(line)
        if current and (started or PASSED_OVER.match(line) or LOCKED.match(line)):
            spans.append({**current, "end": at})
            current = None
        if started:
            current = {"stage": started.group(1), "start": at}
    if current:
        spans.append({**current, "end": end})
    return spans


def git_for_experiments(repo: Path) -> None:
    """Git in the scratch copy, its files committed, and DVC told to use it: `dvc exp run` bases an experiment on a
    commit. Outputs stay out through the project's .gitignore files; a large untracked file stops it first."""
    git = ["git", "-c", "user.name=make pipeline", "-c", "user.email=pipeline@localhost"]
    if not (repo / ".git").exists():
        subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "config", "--local", "core.no_scm", "false"], cwd=repo, check=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--others", "--modified", "--exclude-standard"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    large = [name for name in listed.split("\0")
             if name and (repo / name).is_file() and (repo / name).stat().st_size > LARGEST_COMMITTED_BYTES]
    if large:
        raise SystemExit(f"pipeline: {', '.join(large)} in {repo} would be committed to the copy's git for "
                         f"`dvc exp run` (over {LARGEST_COMMITTED_BYTES >> 20} MiB): list it in a .gitignore, as "
                         "the project's outputs are")
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "make pipeline's copy before dvc exp run"],
                   cwd=repo, check=True)


def exp_run(repo: Path, recipe: str, out: Path, commit: str, sets: list[str], echo: bool = True,
            note: str = "") -> list[dict]:
    """`dvc exp run -S <set> ...` in the copy after its pipeline (git set up there first): a row per stage it ran,
    timed from DVC's lines, then one for the whole command (`stage`: "exp run", the stages it ran), appended to
    `out`."""
    git_for_experiments(repo)
    command = [sys.executable, "-m", "dvc", "exp", "run", *[arg for s in sets for arg in ("-S", s)]]
    shown = " ".join(["dvc exp run", *[f"-S {s}" for s in sets]])
    runner = Runner(repo, repo.parent / "logs", echo)
    lines = []
    print(f"=== {shown} ({time.strftime('%H:%M:%S')})", flush=True)
    with runner.stopping_on_signals():
        memory = GpuMemory()
        wall = time.perf_counter()
        status, tail = runner.run(command, runner.logs / "exp-run.log", lambda line, at: lines.append((at, line)))
        seconds, ended = round(time.perf_counter() - wall, 1), time.time()
        whole_peak = memory.stop()
    exp_row = functools.partial(row_of, recipe, gpus=gpu_count(), commit=commit, ran="dvc exp run", command=shown,
                                status=status, note=note)  # (stage, seconds, peak_gib)
    spans = stage_spans(lines, ended)
    rows = []
    for span in spans:
        row = exp_row(span["stage"], round(span["end"] - span["start"], 1),
                      memory.peak_between(span["start"], span["end"]))
        figures = stage_figures(repo, span["stage"], span["start"], span["end"])
        rows.append({**row, **({"figures": figures} if figures else {})})
    whole = {**exp_row("exp run", seconds, whole_peak), "stages": [span["stage"] for span in spans],
             "outside_stages_seconds": round(seconds - sum(r["seconds"] for r in rows), 1)}
    if status != 0:
        whole["log_tail"] = tail
        print(f"pipeline: {shown} exited {status}; its log: {runner.logs / 'exp-run.log'}", file=sys.stderr)
    rows.append(whole)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'stage':<16}{'seconds':>9}{'peak GiB':>10}  {'status':<8}ran"]
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
        status = "skipped" if row.get("skipped") else ("ok" if row["status"] == 0 else f"exit {row['status']}")
        lines.append(f"{row['stage']:<16}{row['seconds']:>9.1f}{peak:>10}  {status:<8}{row['command']}")
    ran = [r for r in rows if not r.get("skipped") and r["stage"] != "exp run"]
    lines.append(f"{'total':<16}{sum(r['seconds'] for r in ran):>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("stages", nargs="*", help="only these stages (default: all, in dvc.yaml's order)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the (scratch) repository to run in")
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file rows are appended to")
    parser.add_argument("--commit", default="unknown", help="the source's commit, recorded in each row")
    parser.add_argument("--force", action="store_true", help="dvc repro -f: run stages that are up to date too")
    parser.add_argument("--cmd", action="store_true", help="run each stage's cmd instead of `dvc repro -s`")
    parser.add_argument("--note", default="", help="recorded in each row (what this run was: its overrides, why)")
    parser.add_argument("--exp", nargs="+", metavar="KEY=VALUE",
                        help="after the stages, `dvc exp run -S KEY=VALUE ...` in the copy (git set up there), each "
                             "stage it runs timed")
    args = parser.parse_args(argv)
    rows = run_pipeline(args.repo.resolve(), args.recipe, args.out.resolve(), args.commit, args.stages, args.force,
                        not args.cmd, note=args.note)
    if args.exp and all(r["status"] == 0 for r in rows):
        rows += exp_run(args.repo.resolve(), args.recipe, args.out.resolve(), args.commit, args.exp, note=args.note)
    print(f"\n{args.recipe} ({rows[0]['gpus'] if rows else 0} GPU, {rows[0]['ran'] if rows else '-'}; "
          f"rows appended to {args.out}):\n{table(rows)}")
    failed = [r for r in rows if r["status"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
