"""Padding-free rows on the CPU. torch_varlen, torch's FlashAttention over them: the model's plumbing (sequence
bounds from TRL's collator, grouped key-value heads, the layout transformers expects) over the pure-torch reference
kernel, the choice among torch's versions of varlen_attn, and where it runs (the kernel itself is checked on a GPU by
benchmarks/check_kernels.py --only varlen_attention). And gpt-oss's own attention, whose masks mask_packed_rows builds
from the position_ids."""
import inspect

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lora_pipeline.model import varlen_attention
from lora_pipeline.families.gpt_oss.packed_masks import mask_packed_rows
from lora_pipeline.model.loading import inference_attention, runnable_implementations


def assert_packed_as_alone(model, batch, rows, alone_attention: str, packed_attention: str = varlen_attention.NAME):
    """The model under `packed_attention` over the packed `batch` of `rows`: each row's logits and every gradient
    equal those of the rows run alone under `alone_attention`. Returns the packed run's gradients."""
    model.config._attn_implementation = packed_attention
    out = model(**batch)
    out.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.config._attn_implementation = alone_attention
    start, losses = 0, 0
    for row in rows:
        alone = model(input_ids=torch.tensor([row]), labels=torch.tensor([row]))
        torch.testing.assert_close(out.logits[:, start:start + len(row)], alone.logits, rtol=1e-5, atol=1e-5)
        losses = losses + alone.loss * (len(row) - 1)
        start += len(row)
    (losses / sum(len(row) - 1 for row in rows)).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    return packed_grads


def test_packed_rows_attend_within_their_own_sequence(monkeypatch):
    """Three rows packed into one, with the bounds TRL's padding-free collator computes on the CPU and a padded tail
    (each pad token a sequence of its own, as pad_to_multiple_of leaves it): each row's logits and the loss's
    gradients are those of the rows run alone under sdpa; grouped key-value heads (4 query heads, 2 key-value)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    monkeypatch.setattr(varlen_attention, "causal_varlen_attention", varlen_attention.reference_varlen_attention)
    varlen_attention.register()
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    rows = [torch.randint(3, 97, (n,)).tolist() for n in (50, 7, 33)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=32)(
        [{"input_ids": row} for row in rows])
    assert batch["input_ids"].shape[1] == 96 and batch["cu_seq_lens_q"].tolist()[:4] == [0, 50, 57, 90]
    packed_grads = assert_packed_as_alone(model, batch, rows, "sdpa")
    assert packed_grads.keys() == {name for name, _ in model.named_parameters()}


def test_rows_without_bounds_are_each_one_causal_sequence(monkeypatch):
    """Without cu_seq_lens (padded rows, right-padded as training pads them) each row is one causal sequence: the
    real tokens' logits are those of sdpa with the padding mask."""
    monkeypatch.setattr(varlen_attention, "causal_varlen_attention", varlen_attention.reference_varlen_attention)
    varlen_attention.register()
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    model.config._attn_implementation = varlen_attention.NAME
    with torch.no_grad():
        varlen = model(input_ids=ids, attention_mask=mask).logits
        model.config._attn_implementation = "sdpa"
        sdpa = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(varlen[0], sdpa[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen[1, :12], sdpa[1, :12], rtol=1e-5, atol=1e-5)


def tiny_gpt_oss(sliding_window: int):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, head_dim=8,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                          use_cache=False)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # sinks away from zero, so that they count
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    return model


def test_gpt_oss_packed_rows_keep_their_sinks_and_window():
    """gpt-oss over three packed rows (a sliding window of 5 keys in its first layer, learned sinks in both):
    each row's logits and every gradient, the sinks' included, are eager attention's over the rows alone, through
    the sinks folded around the kernel pair (on the CPU the reference pair, which recomputes the backward from the
    output and log-sum-exp it is given, as FlashAttention does)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    varlen_attention.register()
    model = tiny_gpt_oss(sliding_window=5)
    rows = [torch.randint(3, 97, (n,)).tolist() for n in (23, 6, 17)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": row} for row in rows])
    packed_grads = assert_packed_as_alone(model, batch, rows, "eager")
    assert any(n.endswith("sinks") for n in packed_grads)


def test_gpt_oss_eager_attention_keeps_packed_rows_apart():
    """transformers' gpt-oss builds its masks without the position_ids, so under eager attention each packed row
    would attend to the rows before it. With mask_packed_rows each row's logits and every gradient are those of the
    rows alone; torch_varlen, which reads the bounds itself, and Qwen2, which passes the position_ids, get no hook."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = [torch.randint(3, 97, (n,)).tolist() for n in (23, 6, 17)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": row} for row in rows])
    model = tiny_gpt_oss(sliding_window=5)
    model.config._attn_implementation = "eager"
    assert mask_packed_rows(model).startswith("eager: masks from the position_ids")
    assert_packed_as_alone(model, batch, rows, "eager", packed_attention="eager")
    unhooked = tiny_gpt_oss(sliding_window=5)
    unhooked.config._attn_implementation = varlen_attention.NAME
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert mask_packed_rows(unhooked) is None and mask_packed_rows(qwen2) is None


def test_the_sinks_are_folded_around_the_kernel_pair():
    """sink_varlen_attention's output and gradients (queries, keys, values, sinks) against the same attention
    written out: scores, the sink as one more logit of each softmax with no value, the window; in float64."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(11, heads, 4, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 7, 11], dtype=torch.int32)
    grad = torch.randn(11, 4, 4, dtype=torch.float64)

    def written_out():
        outs = []
        for start, end in ((0, 7), (7, 11)):
            keys, values = (t[start:end].repeat_interleave(2, dim=1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * 0.3
            behind = torch.arange(end - start)[:, None] - torch.arange(end - start)[None, :]
            scores = scores.masked_fill((behind < 0) | (behind >= 3), float("-inf"))
            with_sink = torch.cat([scores, sinks[:, None, None].expand(-1, end - start, 1)], dim=-1)
            probs = torch.softmax(with_sink, dim=-1)[..., :-1]
            outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        return torch.cat(outs)

    results = []
    for attention in (lambda: varlen_attention.sink_varlen_attention(q, k, v, sinks, cu, 7, 0.3, 3), written_out):
        out = attention()
        results.append((out, *torch.autograd.grad(out, (q, k, v, sinks), grad)))
    for folded, written in zip(*results):
        torch.testing.assert_close(folded, written)


@pytest.mark.parametrize("version", ["2.11", "2.13"])
def test_the_kernel_is_called_as_each_torch_version_takes_it(monkeypatch, version):
    """torch 2.10/2.11's varlen_attn takes is_causal and neither a scale nor grouped heads (the key-value heads are
    repeated and the queries scaled instead); later ones take a causal window, the scale and enable_gqa. Either way
    the result is the reference's."""
    from torch.nn.attention import varlen

    calls = []
    if version == "2.11":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            calls.append({"is_causal": is_causal, "heads": (query.shape[1], key.shape[1])})
            default_scale = query.shape[-1] ** -0.5
            return varlen_attention.reference_varlen_attention(query, key, value, cu_seq_q, max_q, default_scale)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
            calls.append({"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa,
                          "heads": (query.shape[1], key.shape[1])})
            return varlen_attention.reference_varlen_attention(query, key, value, cu_seq_q, max_q, scale)
    assert set(inspect.signature(fake).parameters) >= {"query", "cu_seq_q", "max_q"}
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    torch.manual_seed(0)
    q, k, v = torch.randn(30, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    cu = torch.tensor([0, 10, 25, 30], dtype=torch.int32)
    out = varlen_attention.causal_varlen_attention(q, k, v, cu, 15, 0.2)
    torch.testing.assert_close(out, varlen_attention.reference_varlen_attention(q, k, v, cu, 15, 0.2))
    expected = ({"is_causal": True, "heads": (4, 4)} if version == "2.11" else
                {"window_size": (-1, 0), "scale": 0.2, "enable_gqa": True, "heads": (4, 2)})
    assert calls == [expected]


def test_where_torch_varlen_runs():
    """A GPU's training attention, gpt-oss's too; on a CPU sdpa stands in (recorded), eager for gpt-oss; decoding
    and the held-out loss (left-padded or whole rows) run sdpa, gpt-oss eager."""
    from types import SimpleNamespace

    asked = SimpleNamespace(attn_implementation="torch_varlen", experts_implementation="eager")
    chosen = runnable_implementations("qwen2", asked)
    if torch.cuda.is_available():
        assert chosen["attention"] == "torch_varlen"
    else:
        assert chosen["attention"] == "sdpa" and chosen["notes"] == ["torch_varlen needs a CUDA GPU"]
    gpt_oss = runnable_implementations("gpt_oss", asked)
    assert gpt_oss["attention"] == ("torch_varlen" if torch.cuda.is_available() else "eager")
    assert inference_attention("qwen2", "torch_varlen")[0] == "sdpa"
    assert inference_attention("gpt_oss", "torch_varlen")[0] == "eager"


def test_the_kernel_call_compiles_into_one_graph_without_a_warning(monkeypatch):
    """Inside a compiled decoder layer: torch.compile traces the check of the kernel's arguments into the graph,
    with no warning (it warns of possible silent errors where it traces through a functools.lru_cache), and a
    second call runs the same graph (a cache filled while tracing would make it compile again)."""
    import warnings

    from torch._dynamo.utils import counters
    from torch.nn.attention import varlen

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False):  # one sequence: causal attention over the rows
        rows = [t.transpose(0, 1)[None] for t in (query, key, value)]
        return torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True, scale=scale,
                                                                enable_gqa=enable_gqa)[0].transpose(0, 1)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    torch.manual_seed(0)
    q, k, v = torch.randn(30, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(varlen_attention.causal_varlen_attention, backend="eager", fullgraph=True)
        out = compiled(q, k, v, cu, 30, 0.2)
        compiled(q, k, v, cu, 30, 0.2)
    assert [str(w.message) for w in caught] == []
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, varlen_attention.reference_varlen_attention(q, k, v, cu, 30, 0.2))
