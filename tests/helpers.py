"""What several tests build on that the pipeline itself never calls."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from lora_pipeline.config.params import ROOT
from lora_pipeline.data.builtin import LANGUAGES
from lora_pipeline.data.sources import load_data
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint
from lora_pipeline.model.tiny import random_gpt_oss

LANGUAGE_CODES = {name: code for code, name in LANGUAGES.items()}


def load_rows(data_params) -> tuple[list[dict], dict]:
    """The usable rows of the configured source, and what reading them found (rows in, kept, dropped per reason)."""
    rows, counts, _ = load_data(data_params)
    return rows, counts


def word_tokenizer(vocab: dict[str, int]):
    """A whitespace word-level tokenizer over `vocab` (t0 padding, t1 unknown, t2 end of text), for tests that need
    token ids they can write by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2")


def build_tiny_gpt_oss(out_dir, **sizes) -> None:
    """Write a randomly initialised tiny gpt-oss (see random_gpt_oss) to out_dir as an MXFP4 checkpoint."""
    save_mxfp4_checkpoint(random_gpt_oss(**sizes), out_dir)


# Prompts for a tiny gpt-oss read by word_tokenizer: 3 to 40 words, one token each (t30-t199: no word starts with a
# special token's text, t0 or t2)
GPT_OSS_PROMPTS = [" ".join(f"t{(7 * i + 3 * j) % 170 + 30}" for j in range(n))
                   for i, n in enumerate([5, 17, 9, 30, 3, 24, 11, 40])]


def decoding_gpt_oss(folder):
    """The tiny gpt-oss in `folder`, in float32 with grouped experts, switched to what generation runs
    (use_for_generation), its attention sinks far from zero: each head's sink takes a real share of its attention."""
    from lora_pipeline.evaluate.generation import use_for_generation
    from lora_pipeline.model.loading import load_model

    params = SimpleNamespace(dtype="float32", attn_implementation="eager", experts_implementation="grouped_mm",
                             trust_remote_code=False)
    model = load_model(folder, params).eval()
    use_for_generation(model)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_(0, 2)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, store: Path) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:port over a sqlite file, returned once it accepts connections. Without MLflow's
    job runner (eight more processes for its GenAI jobs, which nothing here uses)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{store / 'server.db'}", "--artifacts-destination",
         str(store / "artifacts"), "--workers", "1"], env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while True:  # no time limit: a loaded machine starts it slowly; a server that exits fails the test
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            assert server.poll() is None, "mlflow server exited"
            time.sleep(0.5)


def stop(server: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if server.poll() is None:
        os.killpg(server.pid, sig)
    server.wait(timeout=60)


DELETE = object()  # a change that removes the key


def shipped(**dotted) -> dict:
    """params.yaml as shipped, with dotted keys set (or deleted with DELETE)."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return raw
