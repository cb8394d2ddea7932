"""Same params and code: byte-identical outputs from two clones at different paths under different instruction-set
settings, and the committed results are what this machine computes."""
import os
import subprocess
import sys

import pytest
import yaml
from conftest import OTHER_INSTRUCTION_SET, ROOT, SHORT_RUN_OUTPUTS, run, run_env

from lora_pipeline.config.cpu_numerics import PINNED, PINNED_CACHE

# Float work whose rounding depends on the kernels each library picks: matmul (MKL), silu, softmax, log1p (ATen).
PROBE = """
import hashlib, sys
if sys.argv[1] == "pinned":
    import stages  # what every stage imports first
import torch
g = torch.Generator().manual_seed(0)
x, w = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
y = torch.nn.functional.silu(x @ w).softmax(-1).log1p()
print(torch.backends.cpu.get_cpu_capability(), hashlib.md5(y.numpy().tobytes()).hexdigest())
"""


def probe(mode: str, script: str = PROBE, **env) -> str:
    """What script (PROBE: '<capability PyTorch runs> <md5 of its result>') prints in a fresh process."""
    env = {**{k: v for k, v in run_env().items() if k != "LORA_PIPELINE_NATIVE_CPU"}, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_two_clones_produce_the_same_bytes(short_runs):
    first, second = short_runs  # SHORT_RUN, each clone reproduced up to merge, the second under another setting
    for clone in (first, second):
        assert str(clone.repo) not in clone.files["models/adapter/adapter_config.json"].decode()
        assert "seconds" not in clone.files["metrics/train.json"].decode()
    assert set(first.md5s) == set(SHORT_RUN_OUTPUTS)
    assert first.md5s == second.md5s


def test_the_instruction_set_setting_changes_the_bits_unless_pinned():
    native, other = probe("native"), probe("native", **OTHER_INSTRUCTION_SET)
    if native.split()[0] == other.split()[0]:
        pytest.skip(f"this CPU runs {native.split()[0]} kernels either way")
    assert native != other  # the setting matters here, so the pipeline's clones are a real comparison
    pinned = probe("pinned")
    assert pinned.startswith("AVX2 ") and probe("pinned", **OTHER_INSTRUCTION_SET) == pinned
    assert probe("pinned", LORA_PIPELINE_NATIVE_CPU="1", **OTHER_INSTRUCTION_SET) == other


# A matrix product of a shape that a q/k/v projection of the default's training meets: MKL's code under the pin rounds
# it by how many threads split it.
THREAD_PROBE = """
import hashlib, sys
if sys.argv[1] == "pinned":
    import stages  # what every stage imports first
import torch
g = torch.Generator().manual_seed(0)
x, w, b = torch.randn(3056, 128, generator=g), torch.randn(128, 128, generator=g), torch.randn(128, generator=g)
print(torch.get_num_threads(), hashlib.md5(torch.nn.functional.linear(x, w, b).numpy().tobytes()).hexdigest())
"""


def test_the_thread_count_changes_the_bits_so_a_cpu_process_runs_a_fixed_one():
    def thread_probe(mode, threads):
        return probe(mode, THREAD_PROBE, CUDA_VISIBLE_DEVICES="", MKL_CBWR=PINNED["MKL_CBWR"], MKL_DYNAMIC="FALSE",
                     OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)).split()

    native = {threads: thread_probe("native", threads) for threads in (2, 3, 8)}
    assert len({md5 for _, md5 in native.values()}) > 1  # the count matters
    assert thread_probe("pinned", 8) == thread_probe("pinned", 1) == native[2]


def test_the_committed_results_are_what_a_fresh_clone_computes(repo):
    """The default pipeline, run from scratch here, gives the md5s the repository commits (evaluate and register
    read MGSM in the test copy, so they are left out), on any x86-64 CPU with AVX2, Intel's or AMD's. Other tests run
    experiments in that copy later: its dvc.lock is read as the fixture committed it."""
    repo, _ = repo
    baseline = run(["git", "log", "--format=%H", "--grep=^baseline$"], repo).split()[-1]

    def md5s(lock_text):
        lock = yaml.safe_load(lock_text)["stages"]
        return {out["path"]: out["md5"] for name in ("fetch", "split", "train", "merge")
                for out in lock[name]["outs"]}

    assert md5s(run(["git", "show", f"{baseline}:dvc.lock"], repo)) == md5s((ROOT / "dvc.lock").read_text())


def test_a_saved_tokenizer_does_not_record_offline_mode(tmp_path):
    """HF_HUB_OFFLINE=1 (set for the tests) makes transformers load with local_files_only; the tokenizer that train and
    merge save must not record it, or the adapter's and merged model's bytes would depend on the environment."""
    import json

    from lora_pipeline.data import builtin as builtin_data
    from lora_pipeline.model.loading import load_tokenizer
    from lora_pipeline.model.tiny import tokenizer_corpus, train_tokenizer

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    train_tokenizer(tokenizer_corpus(builtin_data.generate(50, seed=1)), 400, "tiny-qwen2", tmp_path / "base")
    load_tokenizer(tmp_path / "base").save_pretrained(tmp_path / "saved")
    assert "local_files_only" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())


# torch.compile of the packed experts' decode (lora_pipeline.families.gpt_oss.mxfp4_experts), first in a pinned
# process, then in one that is not: a kernel cached for AVX2 and loaded on an AVX-512 CPU corrupted the heap
# (torch 2.11).
COMPILE_PROBE = """
import sys
if sys.argv[1] == "pinned":
    import stages  # what every stage imports first
import torch
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk
from lora_pipeline.families.gpt_oss.mxfp4_experts import decode_weight
blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(255, 1).reshape(255, 16, 1, 16)
scales = torch.arange(255, dtype=torch.int32).to(torch.uint8).reshape(-1, 1, 1).expand(-1, 16, 1).contiguous()
for dtype in (torch.bfloat16, torch.float32):
    assert torch.equal(decode_weight(blocks, scales, dtype, "compiled"), expert_from_disk(blocks, scales, dtype))
print("equal")
"""


def test_pinned_processes_compile_into_a_cache_of_their_own(tmp_path):
    native = probe("native").split()[0]
    if native == "AVX2":
        pytest.skip("this CPU runs AVX2 kernels unpinned too: one cache serves both")
    # An empty cache of compiled graphs for the two; Inductor's precompiled headers, keyed by the compiler's flags,
    # stay in the temp folder that every process of the run shares, as they do for a user's processes.
    cache = tmp_path / "inductor"
    env = {**{k: v for k, v in run_env().items() if k != "LORA_PIPELINE_NATIVE_CPU"}, "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    for mode in ("pinned", "native"):
        result = subprocess.run([sys.executable, "-c", COMPILE_PROBE, mode], env=env, capture_output=True, text=True)
        assert (result.returncode, result.stdout.strip()) == (0, "equal"), f"{mode}: {result.stderr[-3000:]}"
    assert (cache / PINNED_CACHE / "fxgraph").is_dir() and (cache / "fxgraph").is_dir()  # one graph cache each
