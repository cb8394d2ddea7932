"""The train stage's trainer levers that can be checked on a CPU: flex attention with eagerly built block masks."""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, masking_utils

from lora_pipeline.training import build_block_masks_eagerly


def test_eager_block_masks_keep_packed_rows_apart(monkeypatch):
    """Two rows packed into one (padding-free, told apart by position_ids) under flex attention with eagerly built
    block masks give each row's logits as the row alone gives them under sdpa."""
    monkeypatch.setattr(masking_utils, "create_block_mask", masking_utils.create_block_mask)  # undone after the test
    build_block_masks_eagerly()
    assert masking_utils.create_block_mask.__module__ == "lora_pipeline.training"
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    lengths = [150, 180]  # the packed length spans three 128-token tiles, a row boundary inside one of them
    ids = torch.randint(0, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    model.config._attn_implementation = "flex_attention"
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    model.config._attn_implementation = "sdpa"
    start = 0
    for n in lengths:
        with torch.no_grad():
            alone = model(input_ids=ids[:, start:start + n], use_cache=False).logits
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-4, atol=1e-4)
        start += n
