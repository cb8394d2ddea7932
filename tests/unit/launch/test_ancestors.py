"""A stage's command sees every process up to the DVC process that runs it, the shell between included, and
notices when DVC is gone while that shell lives on."""
import contextlib
import subprocess
import sys
import time

import psutil
import pytest

from lora_pipeline.launch.ancestors import alive, is_dvc
from tests.conftest import ROOT, run_env, written

# Started by DVC's stand-in through /bin/sh, as DVC starts a stage's command (`; true` keeps any shell from exec-ing
# it); prints the chain it sees, then polls it until DVC is gone.
STAGE = """
import sys, time
from lora_pipeline.launch.ancestors import any_gone, dvc_ancestors
chain = dvc_ancestors()
print(' | '.join(f'{p.pid} {p.cmdline()[0]}' for p in chain), flush=True)
while not any_gone(chain):
    time.sleep(0.1)
print('dvc gone', flush=True)
"""
# DVC's stand-in: runs its argument as DVC runs a stage's cmd.
RUNS_A_STAGE = "import subprocess, sys\nsubprocess.run(['/bin/sh', '-c', sys.argv[1]])\n"


@pytest.mark.parametrize("started_as", ["script", "-m", "__main__"])
def test_a_command_under_a_shell_notices_that_dvc_is_gone(tmp_path, started_as):
    """DVC started as its script (`dvc repro`), as a module, and as its queue workers start it."""
    (tmp_path / "dvc").mkdir()
    (tmp_path / "dvc" / "__init__.py").write_text("")  # a regular package: found before the installed DVC
    (tmp_path / "dvc" / "__main__.py").write_text(RUNS_A_STAGE)
    script = tmp_path / "bin" / "dvc"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{RUNS_A_STAGE}")
    script.chmod(0o755)
    dvc = {"script": [str(script)], "-m": [sys.executable, "-m", "dvc"],
           "__main__": [sys.executable, str(tmp_path / "dvc" / "__main__.py")]}[started_as]
    stage = tmp_path / "stage.py"
    stage.write_text(STAGE)
    env = run_env(PYTHONPATH=str(ROOT))
    descendants = []
    with open(tmp_path / "out", "w+b") as out:
        proc = subprocess.Popen([*dvc, f"{sys.executable} {stage}; true"], stdout=out, cwd=tmp_path, env=env)
        try:
            while not written(out) and proc.poll() is None:
                time.sleep(0.1)
            assert written(out), f"DVC's stand-in exited {proc.returncode} before the stage printed its chain"
            descendants = psutil.Process(proc.pid).children(recursive=True)  # the shell and the stage
            chain = written(out).splitlines()[0].split(" | ")
            assert chain[-1].split()[0] == str(proc.pid), chain
            assert chain[0].split()[1] == "/bin/sh" and len(chain) == 2, chain  # the shell, which outlives DVC
            proc.kill()
            proc.wait()
            while "dvc gone" not in written(out) and any(map(alive, descendants)):  # the shell ends after the stage
                time.sleep(0.1)
            assert "dvc gone" in written(out), written(out)
        finally:  # nothing outlives a failed check
            proc.kill()
            for process in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()


def test_only_dvc_is_taken_for_dvc():
    assert is_dvc(["/venv/bin/python", "/venv/bin/dvc", "exp", "exec-run"])
    assert is_dvc(["/usr/local/bin/dvc", "repro"])
    assert is_dvc(["python", "-m", "dvc", "repro"])
    assert is_dvc(["python", "/venv/lib/site-packages/dvc/__main__.py", "exp", "queue-worker"])
    assert not is_dvc(["python", "-m", "stages.train"])
    assert not is_dvc(["/bin/sh", "-c", "dvc repro"])
    assert not is_dvc(["python", "/repo/dvc.yaml"])
    assert not is_dvc([])
