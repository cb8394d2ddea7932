"""benchmarks/quantization.py: its arguments, and the params it trains with."""
import importlib.util

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("quantization_benchmark", ROOT / "benchmarks" / "quantization.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_defaults_measure_the_qwen2_recipe_with_every_method():
    args = bench.parse_args([])
    assert args.methods == ["none", "nf4", "int8"] and args.steps == 30 and not args.tiny
    params = args.params
    assert params.model.name == "Qwen/Qwen2-0.5B" and params.quantization.method == "none"
    assert params.train.sft.max_steps == bench.WARM_STEPS + 30 and params.train.checkpoint_steps == 0
    assert params.data.builtin_rows > 0  # the built-in rows, whatever the recipe's data.source


def test_one_method_with_overrides():
    args = bench.parse_args(["--method", "nf4", "--steps", "5", "--set", "quantization.compute_dtype=bfloat16",
                             "--set", "train.sft.per_device_train_batch_size=8"])
    params = args.params
    assert params.quantization.method == "nf4" and params.quantization.compute_dtype == "bfloat16"
    assert params.train.sft.per_device_train_batch_size == 8 and params.train.sft.max_steps == bench.WARM_STEPS + 5


@pytest.mark.parametrize("argv, message", [
    (["--set", "lora.r=0"], "lora.r: Input should be greater than or equal to 1"),
    (["--set", "quantization.method"], "--set quantization.method: expected KEY=VALUE"),
    (["--set", "nosection.key=1"], "--set nosection.key=1: expected KEY=VALUE with KEY a dotted params key"),
    (["--recipe", "missing"], "--recipe: no recipe 'missing'"),
])
def test_bad_arguments_exit_naming_them(argv, message):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(argv)
    assert message in str(exited.value)


@pytest.mark.parametrize("argv", [["--methods", "fp8"], ["--steps", "0"]])
def test_argparse_refuses(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error" in capsys.readouterr().err
