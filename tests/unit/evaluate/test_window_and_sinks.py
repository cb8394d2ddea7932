"""The evaluate stage's generate on a tiny gpt-oss whose sliding window is shorter than its rows: the window and the
attention sinks each change what it decodes."""
import pytest

from helpers import GPT_OSS_PROMPTS, build_tiny_gpt_oss, decoding_gpt_oss, word_tokenizer
from lora_pipeline.evaluate.generation import generate_from_prompts

WINDOW = 16
NEW_TOKENS = 24
# 8 rows of 27-64 tokens once generated: every row outgrows the window
PROMPTS = GPT_OSS_PROMPTS


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    build_tiny_gpt_oss(folder, vocab_size=512, sliding_window=WINDOW)
    return decoding_gpt_oss(folder), word_tokenizer({f"t{i}": i for i in range(512)})


def stage_generate(model, tokenizer, batch_size=3):
    return generate_from_prompts(model, tokenizer, PROMPTS, NEW_TOKENS, batch_size, min_new_tokens=NEW_TOKENS)


def test_the_window_and_the_sinks_change_what_generate_decodes(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert all(len(p.split()) == len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    reference = stage_generate(model, tokenizer)
    model.config.sliding_window = 4096
    try:
        assert stage_generate(model, tokenizer) != reference
    finally:
        model.config.sliding_window = WINDOW
    sinks = [layer.self_attn.sinks.data.clone() for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.sinks.data.zero_()
    try:
        assert stage_generate(model, tokenizer) != reference
    finally:
        for layer, kept in zip(model.model.layers, sinks):
            layer.self_attn.sinks.data.copy_(kept)
    assert stage_generate(model, tokenizer) == reference

