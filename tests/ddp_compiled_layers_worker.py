"""Run by test_training.py under torchrun (2 CPU processes over gloo): the train stage's trainer under DDP, its
decoder layers eager and then compiled (dynamo and AOT autograd, as on a GPU), trains the same adapter."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_pipeline.training import compile_decoder_layers  # noqa: E402
from test_training import _tiny_trainer  # noqa: E402


def main():
    out = Path(sys.argv[1])
    adapters = {}
    for name in ("eager", "compiled"):
        trainer, record = _tiny_trainer(out, name, [])
        assert record["distributed"] == "MULTI_CPU" and record["processes"] == 2, record
        if name == "compiled":
            compile_decoder_layers(trainer.model, "default", device_type="cuda", backend="aot_eager")
        trainer.train()
        adapters[name] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    if trainer.is_world_process_zero():
        for key, weight in adapters["eager"].items():
            torch.testing.assert_close(adapters["compiled"][key], weight, rtol=1e-5, atol=1e-6)
        (out / "same").write_text(str(len(adapters["eager"])))


if __name__ == "__main__":
    main()
