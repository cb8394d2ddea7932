"""A stage's command sees every process up to the DVC process that runs it, the shell between included, and
notices when DVC is gone while that shell lives on."""
import os
import subprocess
import sys
import time

from tests.conftest import written

# Started by a process named dvc through /bin/sh, as DVC starts a stage's command (`; true` keeps any shell from
# exec-ing it); prints the chain it sees, then polls it until DVC is gone.
STAGE = """
import sys, time
from lora_pipeline.launch.ancestors import any_gone, dvc_ancestors
chain = dvc_ancestors()
print(' | '.join(' '.join(p.cmdline()[:2]) for p in chain), flush=True)
while not any_gone(chain):
    time.sleep(0.1)
print('dvc gone', flush=True)
"""


def test_a_command_under_a_shell_notices_that_dvc_is_gone(tmp_path):
    dvc = tmp_path / "dvc"
    dvc.write_text(f"#!{sys.executable}\nimport subprocess, sys\nsubprocess.run(['/bin/sh', '-c', sys.argv[1]])\n")
    dvc.chmod(0o755)
    stage = tmp_path / "stage.py"
    stage.write_text(STAGE)
    with open(tmp_path / "out", "w+b") as out:
        proc = subprocess.Popen([str(dvc), f"{sys.executable} {stage}; true"], stdout=out, cwd=os.getcwd())
        while not written(out):
            time.sleep(0.1)
        chain = written(out).splitlines()[0].split(" | ")
        assert chain[-1] == f"{sys.executable} {dvc}", chain
        assert chain[0].startswith("/bin/sh -c"), chain  # the shell, which outlives DVC
        proc.kill()
        proc.wait()
        while "dvc gone" not in written(out):
            time.sleep(0.1)
