"""A function run in a child Python process, so that the libraries it imports (torch, transformers, MLflow: seconds)
stay out of the calling one: validate derives what it needs from them there, once per cache entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = str(Path(__file__).resolve().parents[2])  # the folder holding lora_pipeline: the child imports this copy

# The child ends without Python's cleanup at exit: a last garbage collection over all that torch and transformers
# created on import takes seconds, and the answer is written and closed by then.
RUN = """import importlib, json, os, sys
module, name, args, out = sys.argv[1:]
try:
    answer = {"value": getattr(importlib.import_module(module), name)(*json.loads(args))}
except (ValueError, OSError) as exc:
    answer = {"error": "OSError" if isinstance(exc, OSError) else "ValueError", "message": str(exc)}
with open(out, "w") as file:
    json.dump(answer, file)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def run_apart(function, *args):
    """function(*args) computed in a child Python process: a module-level function of lora_pipeline, whose arguments
    and result are JSON values. A ValueError or OSError it raises is raised here with its message (validate reports
    those as problems); any other failure as a RuntimeError that ends with the child's output."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "answer.json"
        path = os.pathsep.join(filter(None, [PACKAGES, os.environ.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, "-c", RUN, function.__module__, function.__name__, json.dumps(args),
                               str(out)], env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
        answer = json.loads(out.read_text()) if done.returncode == 0 and out.is_file() else None
    if answer is None:
        raise RuntimeError(f"{function.__module__}.{function.__name__} failed in a child process (exit status "
                           f"{done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    if "error" in answer:
        raise (OSError if answer["error"] == "OSError" else ValueError)(answer["message"])
    return answer["value"]
