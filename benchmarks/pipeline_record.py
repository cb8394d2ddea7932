"""Run a pipeline's stages one by one in dvc.yaml's order, timing each: one JSON line per stage, then a table."""
from __future__ import annotations

import argparse
import datetime
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

import yaml

# dvc repro's lines for a stage it did not run
SKIPPED = re.compile(r"didn't change, skipping|is cached - skipping run")
LOG_TAIL_LINES = 30


def dvc_available() -> bool:
    try:
        import dvc.repo  # noqa: F401
    except ImportError:
        return False
    return True


def stage_names(repo: Path) -> list[str]:
    """dvc.yaml's stages in the order written (the pipeline's order)."""
    if dvc_available():
        from lora_pipeline.config.dvcfiles import stages

        return list(stages(repo))
    return list((yaml.safe_load((repo / "dvc.yaml").read_text()) or {}).get("stages", {}))


def stage_cmd(name: str, repo: Path) -> str:
    """The stage's command with `${...}` resolved from params.yaml (DVC's own interpolation where DVC is there)."""
    if dvc_available():
        from lora_pipeline.config.dvcfiles import stage

        cmd = stage(name, repo)["cmd"]
    else:
        cmd = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][name]["cmd"]
        params = yaml.safe_load((repo / "params.yaml").read_text())

        def value(match):
            node = params
            for part in match.group(1).strip().split("."):
                node = node[part]
            return str(node)

        cmd = re.sub(r"\$\{([^}]+)\}", value, cmd) if isinstance(cmd, str) else cmd
    return cmd if isinstance(cmd, str) else " && ".join(cmd)


class GpuMemory:
    """The highest memory.used of any GPU, sampled every `interval` s by one `nvidia-smi -lms` while it runs."""

    def __init__(self, interval: float = 0.5):
        self.peak_mib = None
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

    def stop(self) -> float | None:
        """Stop sampling; the peak in GiB (None without nvidia-smi or a sample)."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=2)
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len([d for d in visible.split(",") if d.strip()])) if visible is not None else count


def stage_figures(repo: Path, stage: str, since: float) -> dict:
    """The JSON files under logs/ whose name starts with the stage's and that the stage wrote."""
    figures = {}
    for path in sorted((repo / "logs").glob(f"{stage}*.json")):
        if path.stat().st_mtime >= since:
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

    def run(self, command: list[str] | str, log: Path) -> tuple[int, str]:
        """(exit status, the last lines of its output); the output goes to `log` and, with echo, to stdout."""
        log.parent.mkdir(parents=True, exist_ok=True)
        tail = []
        with log.open("w") as out:
            self.child = subprocess.Popen(command, cwd=self.repo, shell=isinstance(command, str),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          errors="replace", start_new_session=True)
            for line in self.child.stdout:
                out.write(line)
                tail = (tail + [line.rstrip("\n")])[-LOG_TAIL_LINES:]
                if self.echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            status = self.child.wait()
        self.child = None
        return (-self.stopped if self.stopped else status), "\n".join(tail)

    def stop(self, signum, _frame):
        self.stopped = signum
        if self.child is not None:
            try:
                os.killpg(self.child.pid, signal.SIGTERM)  # the stage and everything it started
            except ProcessLookupError:
                pass


def run_pipeline(repo: Path, recipe: str, out: Path, commit: str, only: list[str] = (), force: bool = False,
                 use_dvc: bool | None = None, echo: bool = True, note: str = "") -> list[dict]:
    """Each stage (all of dvc.yaml's, or `only`) through `dvc repro -s` (else its cmd); a row per stage run appended
    to `out`. Stops at the first failing stage. Returns the rows, with those dvc skipped marked `skipped`."""
    names = stage_names(repo)
    unknown = [name for name in only if name not in names]
    if unknown:
        raise SystemExit(f"pipeline: no stage {', '.join(unknown)} in {repo}/dvc.yaml; stages: {', '.join(names)}")
    use_dvc = dvc_available() if use_dvc is None else use_dvc
    runner = Runner(repo, repo.parent / "logs", echo)
    previous = {s: signal.signal(s, runner.stop) for s in (signal.SIGTERM, signal.SIGINT)}
    gpus = gpu_count()
    rows = []
    try:
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
            row = {"recipe": recipe, "stage": name, "seconds": seconds, "peak_gib": memory.stop(), "gpus": gpus,
                   "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "ran": how, "command": shown, "status": status, **({"note": note} if note else {})}
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
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'stage':<16}{'seconds':>9}{'peak GiB':>10}  {'status':<8}ran"]
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
        status = "skipped" if row.get("skipped") else ("ok" if row["status"] == 0 else f"exit {row['status']}")
        lines.append(f"{row['stage']:<16}{row['seconds']:>9.1f}{peak:>10}  {status:<8}{row['command']}")
    ran = [r for r in rows if not r.get("skipped")]
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
    parser.add_argument("--cmd", action="store_true", help="run each stage's cmd even where DVC is installed")
    parser.add_argument("--note", default="", help="recorded in each row (what this run was: its overrides, why)")
    args = parser.parse_args(argv)
    rows = run_pipeline(args.repo.resolve(), args.recipe, args.out.resolve(), args.commit, args.stages, args.force,
                        False if args.cmd else None, note=args.note)
    print(f"\n{args.recipe} ({rows[0]['gpus'] if rows else 0} GPU, {rows[0]['ran'] if rows else '-'}; "
          f"rows appended to {args.out}):\n{table(rows)}")
    failed = [r for r in rows if r["status"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
