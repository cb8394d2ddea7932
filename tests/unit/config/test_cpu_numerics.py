"""The CPU pins: which switches and thread counts a stage process gets, and when none."""

import pytest

from lora_pipeline.config import cpu_numerics
from lora_pipeline.config.cpu_numerics import PINNED, pin

pytestmark = pytest.mark.unit
THREAD_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC")


@pytest.fixture
def cpu_machine(tmp_path, monkeypatch):
    """A machine with no GPU device node; the node's path."""
    monkeypatch.setattr(cpu_numerics, "GPU_DEVICES", (tmp_path / "nvidia0",))
    return tmp_path / "nvidia0"


@pytest.fixture
def gpu_machine(cpu_machine):
    """A machine whose first GPU device node exists."""
    cpu_machine.touch()


def test_a_process_on_the_cpu_runs_two_threads_whatever_was_asked(cpu_machine):
    environ = {"OMP_NUM_THREADS": "16", "MKL_NUM_THREADS": "16", "MKL_CBWR": "AVX2"}
    pinned = pin(environ)
    assert {k: environ[k] for k in THREAD_KEYS} == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                   "MKL_DYNAMIC": "FALSE"}
    assert {k: environ[k] for k in PINNED} == PINNED and pinned.items() <= environ.items()


def test_each_process_of_a_run_of_several_runs_one_thread(cpu_machine):
    environ = {"WORLD_SIZE": "4", "OMP_NUM_THREADS": "8"}
    pin(environ)
    assert (environ["OMP_NUM_THREADS"], environ["MKL_NUM_THREADS"]) == ("1", "1")


@pytest.mark.parametrize("environ", [{"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                                     {"ACCELERATE_USE_CPU": "True"}])
def test_a_gpu_machine_pins_threads_where_the_process_is_kept_off_its_gpus(gpu_machine, environ):
    pin(environ)
    assert environ["OMP_NUM_THREADS"] == "2"


def test_a_process_that_can_use_a_gpu_keeps_its_threads(gpu_machine):
    environ = {"OMP_NUM_THREADS": "12", "CUDA_VISIBLE_DEVICES": "0", "ACCELERATE_USE_CPU": "False"}
    pin(environ)
    assert environ["OMP_NUM_THREADS"] == "12" and "MKL_DYNAMIC" not in environ
    assert {k: environ[k] for k in PINNED} == PINNED  # the kernels' pins hold there too


def test_the_native_switch_pins_nothing(cpu_machine):
    environ = {cpu_numerics.NATIVE_SWITCH: "1", "OMP_NUM_THREADS": "16"}
    assert pin(environ) == {} and environ == {cpu_numerics.NATIVE_SWITCH: "1", "OMP_NUM_THREADS": "16"}


def test_pinned_processes_keep_inductors_cache_in_a_folder_of_their_own(tmp_path):
    # in the machine's cache, beside validate's: outside the repository copy an experiment runs in
    machine_cache = tmp_path / "xdg" / "lora-pipeline" / "torchinductor" / cpu_numerics.PINNED_CACHE
    assert cpu_numerics.inductor_cache({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == str(machine_cache)
    inside = tmp_path / "cache" / cpu_numerics.PINNED_CACHE
    assert cpu_numerics.inductor_cache({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}) == str(inside)
    assert cpu_numerics.inductor_cache({"TORCHINDUCTOR_CACHE_DIR": str(inside)}) == str(inside)  # pinned again
