"""transformers' continuous batching (benchmarks/generation_speed.py's `cb` variants) decodes as the evaluate stage's
generate does, on a tiny gpt-oss whose sliding window is shorter than its rows and whose attention sinks matter."""
import importlib.util

import pytest

from conftest import ROOT
from helpers import GPT_OSS_PROMPTS, build_tiny_gpt_oss, decoding_gpt_oss, word_tokenizer
from lora_pipeline.evaluate.generation import generate_from_prompts
from lora_pipeline.families.gpt_oss import sink_attention

spec = importlib.util.spec_from_file_location("generation_speed", ROOT / "benchmarks" / "generation_speed.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

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


def test_continuous_batching_decodes_the_tokens_generate_decodes(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    # an EOS token that greedy decoding reaches: both paths must run past it (generate through min_new_tokens,
    # continuous batching by suppressing it)
    free = generate_from_prompts(model, tokenizer, PROMPTS[:1], NEW_TOKENS, 1)
    eos = tokenizer.convert_tokens_to_ids(free[0].split()[3])
    model.generation_config.eos_token_id = [eos]
    try:
        reference = stage_generate(model, tokenizer)
        stats = {}
        got = bench.continuous_batching(model, tokenizer, PROMPTS, NEW_TOKENS, stats, batch_tokens=64)
    finally:
        model.generation_config.eos_token_id = None
    assert got == reference
    assert all(len(text.split()) == NEW_TOKENS for text in got)
    assert f"t{eos}" not in " ".join(got).split()
    assert stats["attention"] == "paged|eager" and stats["new_tokens"] == NEW_TOKENS * len(PROMPTS)
    assert stats["forwards"] > NEW_TOKENS  # 64 tokens a step: the 139 prompt tokens take more than one step
    assert model.config._attn_implementation == sink_attention.NAME  # given back after the call
