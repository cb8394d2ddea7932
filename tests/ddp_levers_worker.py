"""Run by test_training.py under torchrun (2 CPU processes over gloo): the train stage's trainer under DDP, its
decoder layers eager and then compiled (dynamo and AOT autograd, as on a GPU), trains the same adapter; and the
compiled one with train.host_syncs at_logging (figures read across processes at logging steps only, the stop
check over a CPU group) logs what TRL's own way logs."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers, conftest
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit" / "train"))  # test_training
from lora_pipeline.train.training import StopOnSignal, compile_decoder_layers  # noqa: E402
from test_training import _tiny_trainer  # noqa: E402

TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second")


def main():
    out = Path(sys.argv[1])
    adapters, logs = {}, {}
    for name, sets in (("eager", []), ("compiled", []), ("compiled-sync-free", ["train.host_syncs=at_logging"])):
        trainer, record = _tiny_trainer(out, name, ["train.sft.logging_steps=1", *sets])
        assert record["distributed"] == "MULTI_CPU" and record["processes"] == 2, record
        if name != "eager":
            compile_decoder_layers(trainer.model, "default", device_type="cuda", backend="aot_eager")
        trainer.add_callback(StopOnSignal())
        trainer.train()
        adapters[name] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
        logs[name] = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
    if trainer.is_world_process_zero():
        for key, weight in adapters["eager"].items():
            torch.testing.assert_close(adapters["compiled"][key], weight, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(adapters["compiled-sync-free"][key], adapters["compiled"][key], rtol=0, atol=0)
        assert len(logs["compiled"]) == 3 and "entropy" in logs["compiled"][0], logs["compiled"]
        assert logs["compiled-sync-free"] == logs["compiled"], (logs["compiled-sync-free"], logs["compiled"])
        (out / "same").write_text(str(len(adapters["eager"])))


if __name__ == "__main__":
    main()
