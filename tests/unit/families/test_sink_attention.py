"""sink_attention, gpt-oss's decoding attention: transformers' eager arithmetic, each query head with its own sink and
its own key/value head, without repeat_kv's copies, a decode step's in one fused kernel (the CPU's flash attention
here); the GPU check script's comparison (in bfloat16, both against float64) on the CPU."""
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from conftest import ROOT
from helpers import GPT_OSS_PROMPTS, build_tiny_gpt_oss, decoding_gpt_oss, word_tokenizer
from lora_pipeline.families.gpt_oss import sink_attention
from lora_pipeline.families.gpt_oss.sink_attention import grouped_sink_attention

sys.path.insert(0, str(ROOT / "benchmarks"))
import check_sink_attention  # noqa: E402

pytestmark = pytest.mark.unit


def attention_inputs(q_len, k_len, dtype, heads=8, kv_heads=2, batch=3):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, k_len, 16, generator=gen, dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, q_len, k_len, dtype=dtype)
    mask[0, ..., :3] = torch.finfo(dtype).min  # a left-padded row
    module = SimpleNamespace(sinks=torch.linspace(-2, 3, heads, dtype=dtype), num_key_value_groups=heads // kv_heads,
                             training=False)
    return module, q, k, v, mask, 16 ** -0.5


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("q_len, k_len", [(1, 9), (1, 40), (7, 7)])
def test_it_computes_eagers_attention(monkeypatch, fused, q_len, k_len):
    # float64: the same sums in another order agree to rounding far below any dtype a model runs in. A fused decode
    # step (one query a row) returns no weights; 9 keys: a mask not aligned to 8 elements.
    monkeypatch.setattr(sink_attention, "FUSED_DECODE", fused)
    inputs = attention_inputs(q_len, k_len, torch.float64)
    want, want_weights = eager_attention_forward(*inputs)
    got, got_weights = grouped_sink_attention(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if fused and q_len == 1:
        assert got_weights is None
    else:
        torch.testing.assert_close(got_weights, want_weights, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_step_keeps_the_models_dtype_and_takes_no_mask(dtype):
    module, q, k, v, mask, scaling = attention_inputs(1, 12, dtype)
    want, _ = sink_attention.attend(module, q, k, v, None, scaling)
    got, _ = grouped_sink_attention(module, q, k, v, None, scaling)
    assert got.dtype == dtype and got.shape == want.shape == (3, 1, 8, 16)
    torch.testing.assert_close(got, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("queries_at_once", [1, 3, 6])
def test_a_pass_of_more_scores_than_fit_runs_in_chunks_of_queries(monkeypatch, dtype, queries_at_once):
    inputs = attention_inputs(7, 7, dtype)
    whole, _ = grouped_sink_attention(*inputs)
    monkeypatch.setattr(sink_attention, "SCORES_AT_ONCE", 3 * 8 * 7 * queries_at_once)  # rows x heads x keys x queries
    chunked, weights = grouped_sink_attention(*inputs)
    assert weights is None
    assert torch.equal(chunked, whole)  # each query's row of scores is computed as in one piece


def test_each_head_keeps_its_own_sink_and_key_value_head():
    module, q, k, v, mask, scaling = attention_inputs(1, 9, torch.float64)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling)
    swapped = SimpleNamespace(**{**vars(module), "sinks": module.sinks.view(4, 2).t().reshape(-1)})  # interleaved
    assert not torch.allclose(grouped_sink_attention(swapped, q, k, v, mask, scaling)[0], want)
    other_kv = torch.cat([k[:, 1:], k[:, :1]], dim=1)  # query heads 0-3 reading key/value head 1
    assert not torch.allclose(grouped_sink_attention(module, q, other_kv, v, mask, scaling)[0], want)


def test_the_gpu_check_passes_on_the_cpu_and_fails_a_wrong_attention(monkeypatch):
    row = check_sink_attention.check(batch=2, q_len=1, k_len=64, device=torch.device("cpu"))
    assert row["passed"] and row["bitwise_equal"], row  # eager and the unfused grouped attention: the same arithmetic
    assert row["grouped"]["mean_rel_error"] <= row["eager"]["mean_rel_error"] * check_sink_attention.TOLERANCE
    chunked = check_sink_attention.check(batch=2, q_len=16, k_len=16, device=torch.device("cpu"), queries_at_once=5)
    assert chunked["passed"] and chunked["queries_at_once"] == 5, chunked
    assert sink_attention.SCORES_AT_ONCE == 2**30  # set back
    wrong = lambda module, q, k, v, *rest: grouped_sink_attention(module, q, k.flip(2), v, *rest)  # noqa: E731
    monkeypatch.setattr(check_sink_attention, "grouped_sink_attention", wrong)
    assert not check_sink_attention.check(batch=2, q_len=1, k_len=64, device=torch.device("cpu"))["passed"]


def test_the_fused_decode_switch_is_set_back_after_its_block():
    with pytest.raises(RuntimeError):
        with sink_attention.fused_decode(False):
            assert not sink_attention.FUSED_DECODE
            raise RuntimeError
    assert sink_attention.FUSED_DECODE


def test_the_tiny_gpt_oss_decodes_as_under_transformers_eager_attention(tmp_path):
    # a window of 16, shorter than the rows, and sinks far from zero (decoding_gpt_oss): both take part in each step
    build_tiny_gpt_oss(tmp_path, vocab_size=512, sliding_window=16)
    model = decoding_gpt_oss(tmp_path)
    tokenizer = word_tokenizer({f"t{i}": i for i in range(512)})
    tokenizer.padding_side = "left"
    inputs = tokenizer(GPT_OSS_PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")

    def decoded():
        out = model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        return out.sequences, torch.stack(out.logits)

    assert model.config._attn_implementation == sink_attention.NAME
    fused = decoded()
    with sink_attention.fused_decode(False):
        unfused = decoded()
    model.set_attn_implementation("eager")  # transformers' own: repeat_kv's copies of the cache
    eager = decoded()
    for tokens, logits in (fused, unfused):
        assert torch.equal(tokens, eager[0])
        torch.testing.assert_close(logits, eager[1], rtol=1e-4, atol=1e-4)
