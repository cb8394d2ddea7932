"""What a Slurm job's output says: the lines a user sees, and the one line that says how a failed job ended."""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lora_pipeline.launch.checkpoints import kept_clause, signal_name

# srun --label puts the task number before each line a task writes; srun's and slurmstepd's own lines have none.
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$", re.S)
_TASK_ENDED = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.*)$")
_JOB_ENDED = re.compile(r"\*\*\* (?:STEP|JOB) (\d+)\S* ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)")
_OOM = re.compile(r"oom[-_ ]kill", re.I)
_STOP_LINE = re.compile(r"\b\w+ stopped by (SIG\w+) \(signal (\d+)\)")
_DEATH_SIGNAL = re.compile(r"Received \d+ death signal")  # torch's launcher, stopping its workers on a signal
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")  # anywhere: a progress bar may precede it
TIME_LIMIT_SIGNAL = signal.SIGUSR1  # what srun --signal sends every process of the job ahead of launch.slurm.time


@dataclass
class StepOutput:
    """Reads a Slurm job's merged, labelled output line by line (`feed`): which line to show now, and, at the end,
    the one line that says how the job ended (`verdict`). Lines pass through until the first sign of a fault (a task
    that failed, a stop line, a traceback, a cancel); from there on they are held, so that the ranks stopped because
    of that fault fill the log and not the terminal. The failing task's own traceback is shown (`shown_after`)."""
    stage: str
    failed: tuple[str, str, str] | None = None  # the first task Slurm reports: (node, task, what srun said)
    cancelled: tuple[str, str] | None = None  # (job id, reason) of slurmstepd's CANCELLED line; reason "" where it
    # names none (scancel; preemption with a grace time: `cancelled_because` asks Slurm)
    out_of_memory: bool = False
    stop_signals: dict[str, int] = field(default_factory=dict)  # task -> the signal its launcher or process named
    held: dict[str, list[str]] = field(default_factory=dict)  # task -> its lines since the first fault
    faulted: bool = False

    def feed(self, line: str) -> str | None:
        """The line as it should reach the terminal now (its label taken off), or None to hold it."""
        labelled = _LABEL.match(line)
        task, text = (labelled.group(1), labelled.group(2)) if labelled else (None, line)
        if _OOM.search(text):
            self.out_of_memory = True
        if ended := _TASK_ENDED.match(text):
            if self.failed is None and self.cancelled is None:
                self.failed = (ended.group(1), ended.group(2), ended.group(3).strip())
            self.faulted = True
            return None
        if (cancel := _JOB_ENDED.search(text)) and self.cancelled is None and self.failed is None:
            self.cancelled = (cancel.group(1), (cancel.group(2) or "").strip())
        if stop := _STOP_LINE.search(text):
            self.stop_signals.setdefault(task or "", int(stop.group(2)))
        self.faulted = self.faulted or bool(cancel or stop or _TRACEBACK.search(text) or _DEATH_SIGNAL.search(text))
        if self.faulted:
            self.held.setdefault(task or "", []).append(text)
            return None
        return text

    def shown_after(self) -> list[str]:
        """The held lines to show once the job has ended: those of the task that failed first by an error of its own
        (its traceback), none where a signal or Slurm ended it."""
        if self.failed is None or self._how_failed()[1]:
            return []
        return [line for line in self.held.get(self._first_failed_task(), []) if not _STOP_LINE.search(line)]

    def _first_failed_task(self) -> str:
        """The first task of srun's report of the failed ones ("1", "0-1" or "0,2"), as its lines are labelled."""
        return re.split(r"[,-]", self.failed[1])[0]

    def _how_failed(self) -> tuple[str, bool]:
        """(what ended the first failed task, whether a signal or Slurm did rather than an error of its own)."""
        said = self.failed[2]
        if self.out_of_memory:
            return "out of memory (Slurm's oom-kill)", True
        signum = self.stop_signals.get(self._first_failed_task())
        code = re.search(r"exit code (\d+)", said)
        killed = re.search(r"[Kk]illed by signal (\d+)", said)
        if killed:
            return f"killed by {signal_name(int(killed.group(1)))}", True
        if signum is not None:
            return f"its {self.stage} process ended by {signal_name(signum)}", True
        if code and int(code.group(1)) > 128:
            return f"exit code {code.group(1)}, as when {signal_name(int(code.group(1)) - 128)} kills a process", True
        return (f"exit code {code.group(1)}" if code else said), False

    def cancelled_because(self, reason: str) -> None:
        """Slurm's reason for a cancel whose line named none (e.g. PREEMPTION, from the job's state)."""
        if self.cancelled and not self.cancelled[1]:
            self.cancelled = (self.cancelled[0], reason)

    @property
    def preempted(self) -> bool:
        return bool(self.cancelled) and self.cancelled[1] == "PREEMPTION"

    def resubmitted(self, checkpoint: Path | None) -> str:
        """The line for a preempted job that the launcher submits again (Slurm requeues batch jobs only, and this
        stage's job is srun's)."""
        kept = f"kept: checkpoint {checkpoint}; it resumes from there" if checkpoint else "kept: no checkpoint"
        return f"{self.stage}: Slurm preempted the job; {kept}; submitted again, it runs once Slurm gives it nodes"

    def verdict(self, checkpoint: Path | None, time_limit: str = "") -> str:
        """The one line that says how the job ended: what happened first, what Slurm did about it, the checkpoint
        kept and the way on."""
        kept = kept_clause(checkpoint)
        saved_ahead = TIME_LIMIT_SIGNAL in self.stop_signals.values()
        reason = self.cancelled[1] if self.cancelled else None
        if reason == "TIME LIMIT" or (saved_ahead and self.failed and not self.out_of_memory):
            saved = "; every process saved at the step it was at on Slurm's signal" if saved_ahead else ""
            return f"{self.stage}: the Slurm job reached its time limit (launch.slurm.time {time_limit}){saved}; {kept}"
        if self.cancelled:
            return f"{self.stage}: the Slurm job was cancelled ({reason.lower() or 'scancel'}); {kept}"
        if self.failed:
            node, task, _ = self.failed
            how, stopped = self._how_failed()
            how += "" if stopped else " (its error above)"
            return (f"{self.stage}: task {task} on node {node} failed first: {how}; Slurm ended the job's other "
                    f"tasks; {kept}")
        return f"{self.stage}: the Slurm job failed; {kept}"
