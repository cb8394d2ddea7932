"""Generation as evaluate runs it: the implementations chosen for decoding, the experts implementation the loader
honours, and length-sorted batches that do not depend on the number of processes."""
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer

from helpers import GPT_OSS_PROMPTS, build_tiny_gpt_oss, decoding_gpt_oss, word_tokenizer
from lora_pipeline.evaluate import captured_decode
from lora_pipeline.evaluate.generation import (GROUPED_FOR_GENERATION, batches, decode_cache, decoding_implementations,
                                               generate_from_prompts, use_for_generation)
from lora_pipeline.evaluate.heldout import heldout_loss, use_for_loss
from lora_pipeline.families.gpt_oss.sink_attention import NAME as SINKS
from lora_pipeline.evaluate.window_cache import FullWindowLayer, WindowCache, sliding_window
from lora_pipeline.model.loading import experts_implementation, inference_attention, load_model


def model_params(attention="eager", experts="eager"):
    return SimpleNamespace(dtype="float32", attn_implementation=attention, experts_implementation=experts,
                           trust_remote_code=False)


@pytest.mark.parametrize("model_type, attention, experts, want", [
    ("gpt_oss", "flex_attention", "grouped_mm", (SINKS, GROUPED_FOR_GENERATION)),
    ("gpt_oss", "eager", "batched_mm", (SINKS, GROUPED_FOR_GENERATION)),
    ("gpt_oss", "eager", "eager", (SINKS, "eager")),  # eager's arithmetic, the cache read in place
    ("gpt_oss", "sdpa", "eager", ("sdpa", "eager")),  # asked for: kept
    ("qwen2", "flex_attention", None, ("sdpa", None)),  # decodes faster with sdpa
    ("qwen2", "sdpa", None, ("sdpa", None)),
])
def test_decoding_implementations(model_type, attention, experts, want):
    chosen = decoding_implementations(model_type, attention, experts)
    assert (chosen["attention"], chosen["experts"]) == want
    assert bool(chosen["notes"]) == (want != (attention, experts))


@pytest.mark.parametrize("model_type, attention, want", [
    ("gpt_oss", "flex_attention", "eager"),  # padded rows: nothing for a block mask to skip; no sdpa (the sinks)
    ("qwen2", "flex_attention", "sdpa"),  # padded rows: nothing for a block mask to skip, nothing to compile
    ("qwen2", "eager", "eager"),
])
def test_loss_attention(model_type, attention, want):
    chosen, note = inference_attention(model_type, attention)  # what use_for_loss switches to, before the sinks
    assert chosen == want and bool(note) == (want != attention)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    build_tiny_gpt_oss(folder, vocab_size=512, sliding_window=16)
    return folder


@pytest.mark.parametrize("asked", ["eager", "grouped_mm"])
def test_loader_runs_the_experts_implementation_asked_for(tiny_gpt_oss, asked):
    # transformers runs grouped_mm unless told otherwise: eager has to be set, not left to the default
    model = load_model(tiny_gpt_oss, model_params(experts=asked))
    assert experts_implementation(model) == asked


def test_generation_with_grouped_experts_decodes_as_the_expert_loop(tiny_gpt_oss):
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 500 + 3}" for j in range(n)) for i, n in enumerate([5, 17, 9, 30])]
    texts = {}
    for experts in ("eager", "grouped_mm"):
        model = load_model(tiny_gpt_oss, model_params(experts=experts)).eval()
        chosen = use_for_generation(model)
        assert experts_implementation(model) == chosen["experts"]
        torch.manual_seed(0)
        texts[chosen["experts"]] = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=12, batch_size=3,
                                                         min_new_tokens=12)
    assert texts[GROUPED_FOR_GENERATION] == texts["eager"]
    assert all(len(t.split()) == 12 for t in texts["eager"])


def test_use_for_loss_switches_the_model_and_says_what_runs(tiny_gpt_oss):
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    rows = [" ".join(f"t{(7 * i + 3 * j) % 500 + 3}" for j in range(n)) for i, n in enumerate([50, 170, 9, 33])]
    model = load_model(tiny_gpt_oss, model_params(experts="grouped_mm")).eval()
    eager = heldout_loss(model, tokenizer, rows, max_length=2048, batch_size=3)
    chosen = use_for_loss(model)
    assert (chosen["attention"], chosen["experts"]) == (SINKS, "grouped_mm") == (
        model.config._attn_implementation, experts_implementation(model))
    assert chosen["notes"] == [f"gpt-oss's eager attention runs as {SINKS} (no copy of the keys and values per head; "
                               "a decode step's in one fused kernel)"]
    assert heldout_loss(model, tokenizer, rows, max_length=2048, batch_size=3) == eager  # eager's arithmetic


def test_batches_are_length_sorted_and_the_same_for_any_process_count():
    lengths = [30, 5, 17, 5, 40, 12, 8]
    got = batches(lengths, 3)
    assert got == [[1, 3, 6], [5, 2, 0], [4]]  # shortest first; equal lengths keep their order


@pytest.mark.parametrize("decode_step, device_type, want", [
    ("eager", "cuda", "eager"),
    ("cudagraphs", "cuda", "cudagraphs"),
    ("inductor", "cuda", "inductor"),
    ("cudagraphs", "cpu", "eager"),  # needs a GPU: falls back, and says so
])
def test_decode_step_chosen(decode_step, device_type, want):
    chosen = decoding_implementations("qwen2", "sdpa", None, decode_step, device_type)
    assert chosen["decode_step"] == want
    assert bool(chosen["notes"]) == (want != decode_step)


def test_the_cache_a_decode_step_runs_on_is_recorded(tiny_gpt_oss):
    gpt_oss = load_model(tiny_gpt_oss, model_params())
    assert decode_cache("cudagraphs", gpt_oss.config) == "WindowCache"
    assert decode_cache("eager", gpt_oss.config) == "dynamic"
    assert decode_cache("inductor", SimpleNamespace(layer_types=["full_attention"], sliding_window=None)) == "static"
    assert use_for_generation(gpt_oss, "cudagraphs")["cache"] == "dynamic"  # CPU


def test_an_unknown_decode_step_is_refused_by_name():
    with pytest.raises(ValueError, match="eval.decode_step: 'graphs'"):
        decoding_implementations("qwen2", "sdpa", None, "graphs", "cuda")


def tiny_qwen2(folder, initializer_range=0.02):
    """`initializer_range`: larger weights make each token depend on the positions and the keys it attends to, not
    only on the token before it, as a trained model's do."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=initializer_range)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_the_compiled_static_cache_step_decodes_as_the_eager_one(tmp_path):
    # The graph the cudagraphs and inductor steps are built from: a static KV cache and the decode step traced by
    # torch.compile as one graph (fullgraph: a graph break fails), compiled here on the CPU, where the cudagraphs
    # backend records no CUDA graph and runs the traced graph.
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 500 + 3}" for j in range(n)) for i, n in enumerate([5, 17, 9, 30])]
    model = load_model(tiny_qwen2(tmp_path / "qwen2"), model_params()).eval()
    eager = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=12, batch_size=4, min_new_tokens=12)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=12, batch_size=4, min_new_tokens=12,
                                     decode_step="cudagraphs", compile_on_cpu=True)
    assert compiled == eager
    assert all(len(t.split()) == 12 for t in eager)
    # The step reads every weight and the static cache's keys and values where they lie: a CUDA graph copies only
    # the step's own inputs (token, positions, mask), not the model, into its memory each replay.
    kept = counters["cudagraphs_in_place"]
    weights, cache_tensors = len(list(model.parameters())), 2 * model.config.num_hidden_layers
    assert counters["stats"]["unique_graphs"] == 1
    assert kept["static_inputs"] >= weights + cache_tensors and kept["copied_inputs"] <= 4, dict(kept)


def test_the_compiled_step_of_sliding_window_layers_decodes_as_the_eager_one_in_one_graph(tiny_gpt_oss):
    # The window (16 tokens) fills during the prompt and slides for 40 tokens; the short rows' padding lies inside it
    # for the first steps. A compiled step that read the window layers' token count would compile again for every
    # token (dynamic=False) and fail at torch's recompile limit (fullgraph): one graph here.
    model = decoding_gpt_oss(tiny_gpt_oss)
    assert sliding_window(model.config) == 16
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    prompts = GPT_OSS_PROMPTS[:5]
    eager = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=40, batch_size=5, min_new_tokens=40)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=40, batch_size=5, min_new_tokens=40,
                                     decode_step="cudagraphs", compile_on_cpu=True)
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 1
    assert all(len(t.split()) == 40 for t in eager)


def test_the_window_cache_counts_what_the_stock_cache_counts(tiny_gpt_oss):
    # The counts advance outside the decode step (WindowCache.get_mask_sizes): after 40 tokens every window layer
    # holds the stock layer's count, the prompt's 64 plus the 39 tokens fed back.
    model = decoding_gpt_oss(tiny_gpt_oss)
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    inputs = tokenizer(["t40 t41 t42", "t50"], return_tensors="pt", padding="max_length", max_length=64)
    window_cache = WindowCache(model.config, max_cache_len=104)
    assert isinstance(window_cache.layers[0], FullWindowLayer)
    outputs = {}
    for cache in (window_cache, StaticCache(config=model.config, max_cache_len=104)):
        outputs[type(cache).__name__] = model.generate(**inputs, cache=cache, max_new_tokens=40, min_new_tokens=40,
                                                       do_sample=False, pad_token_id=0, disable_compile=True)
        windows = [layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer)]
        assert windows and {layer.cumulative_length_int for layer in windows} == {64 + 39}
    assert torch.equal(outputs["WindowCache"], outputs["StaticCache"])
    window_cache.check_counts()
    window_cache.layers[0].cumulative_length_int += 1  # as if the sizes had been asked for twice in a step
    with pytest.raises(RuntimeError, match="the window layers count .* tokens, the full-attention layers hold 103"):
        window_cache.check_counts()


def left_padded(lengths: list[int], vocab: int = 512):
    rows, width = len(lengths), max(lengths)
    ids, mask = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.long)
    generator = torch.Generator().manual_seed(1)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


@pytest.mark.parametrize("attention, dtype, read_block", [("sdpa", torch.bfloat16, 8), ("eager", torch.bfloat16, 8),
                                                          ("sdpa", torch.float32, 8), ("sdpa", torch.float32, None)])
def test_the_captured_step_decodes_as_generate_on_a_static_cache(tmp_path, attention, dtype, read_block):
    # The step the captured decoder records as a CUDA graph, run eagerly here: its tokens are generate's on the same
    # static cache to the last token, an end of sequence included (padding after it); the rows stop at different
    # steps, and none before the check for every row's end. Blocks of 8 slots: the full-attention layers read 16, 24,
    # ... slots as the cache fills (the default block holds the whole cache here).
    model = load_model(tiny_qwen2(tmp_path / "qwen2", 0.3), model_params(attention)).eval().to(dtype)
    ids, mask = left_padded([3, 9, 14, 6, 11])
    free = captured_decode.greedy_generate(model, ids, mask, 40, pad_token_id=0, capture=False, read_block=read_block)
    eos = sorted({int(free[row, 2 + row]) for row in range(5)})  # every row ends, by its column 2 + row
    model.generation_config.eos_token_id = eos
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                          cache_implementation="static")[:, ids.shape[1]:]
    got = captured_decode.greedy_generate(model, ids, mask, 40, pad_token_id=0, capture=False, read_block=read_block)
    assert want.shape[1] < 40 and (want == 0).any(), "every row ended before the last step, some before others"
    assert torch.equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == 0).all() and got.shape[1] - want.shape[1] < captured_decode.CHECK_FINISHED_EVERY
    if dtype == torch.float32:  # generate's own dynamic cache too, where no rounding tells the caches apart
        dynamic = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                 pad_token_id=0)[:, ids.shape[1]:]
        assert torch.equal(got[:, :dynamic.shape[1]], dynamic)


def test_the_stage_decodes_through_the_captured_step_as_through_generate(tmp_path):
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 500 + 3}" for j in range(n)) for i, n in enumerate([5, 17, 9, 30])]
    model = load_model(tiny_qwen2(tmp_path / "qwen2", 0.3), model_params("sdpa")).eval()
    eager = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=12, batch_size=3)
    stats = {}
    captured = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=12, batch_size=3, stats=stats,
                                     decode_step="captured")
    assert captured == eager and all(eager)
    assert stats["prompts"] == 4 and stats["decode_steps"] == 24
    with pytest.raises(ValueError, match="decodes greedily"):
        generate_from_prompts(model, tokenizer, prompts, 4, 3, decode_step="captured", do_sample=True)


def test_the_captured_step_says_which_models_it_cannot_decode(tmp_path, tiny_gpt_oss):
    model = load_model(tiny_qwen2(tmp_path / "qwen2"), model_params("sdpa"))
    assert captured_decode.unsupported(model) is None
    model.generation_config.repetition_penalty = 1.1
    assert "repetition_penalty" in captured_decode.unsupported(model)
    model.generation_config.repetition_penalty = 1.0
    model.set_attn_implementation("flex_attention")
    assert "not flex_attention" in captured_decode.unsupported(model)
    gpt_oss = load_model(tiny_gpt_oss, model_params())  # sliding-window layers: decoded too
    assert captured_decode.unsupported(gpt_oss) is None


@pytest.mark.parametrize("device_type, want", [("cuda", "captured"), ("cpu", "eager")])
def test_use_for_generation_takes_the_captured_step_where_it_can(tmp_path, tiny_gpt_oss, monkeypatch, device_type,
                                                                  want):
    model = load_model(tiny_qwen2(tmp_path / "qwen2"), model_params("sdpa"))
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device(device_type)))
    chosen = use_for_generation(model, "captured")
    assert (chosen["decode_step"], chosen["cache"]) == (want, "static" if want == "captured" else "dynamic")
    assert bool(chosen["notes"]) == (want != "captured")
    gpt_oss = load_model(tiny_gpt_oss, model_params())
    monkeypatch.setattr(type(gpt_oss), "device", property(lambda self: torch.device(device_type)))
    chosen = use_for_generation(gpt_oss, "captured")  # decodes with grouped_sink_eager: sliding windows and all
    assert (chosen["decode_step"], chosen["cache"], chosen["attention"]) == (
        (want, "WindowCache", SINKS) if want == "captured" else (want, "dynamic", SINKS))


def test_the_captured_step_decodes_sliding_window_layers_with_sinks_as_generate(tiny_gpt_oss, monkeypatch):
    # The window (16 tokens) fills during the prompt (padded to it) and slides for 40 tokens, a ring written in place;
    # the full-attention layers read blocks of 8 slots; the attention sinks matter (test_window_and_sinks). Every
    # row runs the full length: no end of sequence.
    monkeypatch.setattr(captured_decode, "READ_BLOCK", 8)
    model = decoding_gpt_oss(tiny_gpt_oss)
    model.generation_config.eos_token_id = None
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    prompts = GPT_OSS_PROMPTS[:5]
    assert min(len(p.split()) for p in prompts) < 16 < max(len(p.split()) for p in prompts)
    eager = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=40, batch_size=5)
    captured = generate_from_prompts(model, tokenizer, prompts, max_new_tokens=40, batch_size=5,
                                     decode_step="captured")
    assert captured == eager and all(len(t.split()) == 40 for t in eager)
    ids, mask = left_padded([3, 9, 12], vocab=512)
    with pytest.raises(ValueError, match="padded to the sliding window"):
        captured_decode.greedy_generate(model, ids, mask, 4, pad_token_id=0, capture=False)


@pytest.mark.parametrize("model_type", ["qwen2", "gpt_oss"])
def test_the_prompts_pass_in_groups_fills_the_cache_as_one_pass(tmp_path, tiny_gpt_oss, model_type):
    # Rows of 3 to 30 tokens: in 4 groups, each cut to its longest prompt (at least the window, 16, for gpt-oss), the
    # cache's keys and values at every slot a prompt token fills, and each row's last logits, are those of one pass
    # over the whole batch (which also writes keys for the padding, masked).
    model = (load_model(tiny_qwen2(tmp_path / "qwen2", 0.3), model_params("sdpa")).eval() if model_type == "qwen2"
             else decoding_gpt_oss(tiny_gpt_oss))
    ids, mask = left_padded([30, 3, 9, 22, 14, 6, 11, 5])
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    window = sliding_window(model.config)
    caches = [(WindowCache if window else StaticCache)(config=model.config, max_cache_len=40) for _ in range(2)]
    logits = [model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True,
                    logits_to_keep=1).logits[:, -1],
              captured_decode.prefill(model, ids, mask, positions, caches[1], groups=4)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for whole, grouped in zip(*(cache.layers for cache in caches)):
        held = whole.keys.shape[2]
        filled = mask[:, -held:] if held <= 30 else torch.cat([mask, torch.zeros(8, held - 30, dtype=mask.dtype)], 1)
        for mine, theirs in ((grouped.keys, whole.keys), (grouped.values, whole.values)):
            slots = filled.bool()[:, None, :].expand(-1, mine.shape[1], -1)  # [rows, heads, slots]
            torch.testing.assert_close(mine[slots], theirs[slots], rtol=1e-5, atol=1e-5)
        if isinstance(whole, FullWindowLayer):
            assert (grouped.cumulative_length_int, grouped.full) == (whole.cumulative_length_int, whole.full)
        else:
            assert int(grouped.cumulative_length) == int(whole.cumulative_length) == 30
