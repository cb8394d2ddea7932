"""Run by test_training.py under torchrun (2 CPU processes over gloo): a LoRA model sharded by FSDP2 gathers its
trainable tensors whole, and the adapter saved from them loads into a fresh base as the unsharded model was."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_pipeline.train.training import trainable_tensors  # noqa: E402


def lora_model():
    """The same tiny Qwen2 with the same LoRA weights on every call (B not zero, so the adapter changes outputs)."""
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    model = lora_model()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    kinds = sorted({type(p).__name__ for p in model.parameters() if p.requires_grad})
    gathered = trainable_tensors(model)  # every rank takes part
    if dist.get_rank() == 0:
        model.save_pretrained(out, state_dict=gathered)
        unsharded = lora_model().eval()
        reference = {n: p.detach() for n, p in unsharded.named_parameters() if p.requires_grad}
        reloaded = PeftModel.from_pretrained(lora_model().unload(), out).eval()  # refuses any shape not the model's
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            diff = (reloaded(input_ids=ids).logits - unsharded(input_ids=ids).logits).abs().max().item()
        print(json.dumps({"kinds": kinds, "tensors": len(gathered), "reference_tensors": len(reference),
                          "max_tensor_diff": max((gathered[n] - reference[n]).abs().max().item() for n in reference),
                          "max_logit_diff": diff}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
