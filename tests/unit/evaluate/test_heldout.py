"""The held-out loss: the mean next-token loss over the assistant tokens, whatever the batch size and however many
positions the LM head takes at once."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from helpers import word_tokenizer
from lora_pipeline.evaluate import heldout
from lora_pipeline.evaluate.generation import batches
from lora_pipeline.evaluate.heldout import assistant_mask, heldout_loss

VOCAB = 64
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }} t2{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB - 3)} | {"user": VOCAB - 3, "assistant": VOCAB - 2, "system": VOCAB - 1}
    tokenizer = word_tokenizer(vocab)
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    return model, tokenizer


def conversations():
    words = lambda n, k: " ".join(f"t{(k * 7 + j * 5) % 58 + 3}" for j in range(n))  # noqa: E731
    return [[{"role": "user", "content": words(3 + k % 4, k)}, {"role": "assistant", "content": words(2 + k, k + 1)}]
            for k in range(7)]


def reference_loss(model, tokenizer, rows, max_length):
    """Each row alone, through the whole model: the summed loss of its assistant tokens, and their count."""
    total, count = 0.0, 0
    for messages in rows:
        ids, mask = assistant_mask(tokenizer, messages, max_length)
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        keep = torch.tensor(mask[1:]).bool()
        total, count = total + losses[keep].sum().item(), count + int(keep.sum())
    return total / count, count


@pytest.mark.parametrize("batch_size, logits_at_once", [(1, 2**28), (3, 2**28), (7, VOCAB * 5), (2, VOCAB)])
def test_heldout_loss_is_the_mean_over_assistant_tokens(model_and_tokenizer, monkeypatch, batch_size,
                                                        logits_at_once):
    model, tokenizer = model_and_tokenizer
    rows = conversations()
    ids, mask = assistant_mask(tokenizer, rows[0], 2048)
    assert 0 < sum(mask) < len(ids)  # the template marks the assistant's tokens only
    monkeypatch.setattr(heldout, "LOGITS_AT_ONCE", logits_at_once)
    want, count = reference_loss(model, tokenizer, rows, 2048)
    got = heldout_loss(model, tokenizer, rows, max_length=2048, batch_size=batch_size)
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_heldout_loss_cuts_rows_at_max_length(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = conversations()
    want, count = reference_loss(model, tokenizer, rows, 8)
    got = heldout_loss(model, tokenizer, rows, max_length=8, batch_size=4)
    assert got["tokens"] == count < reference_loss(model, tokenizer, rows, 2048)[1]
    assert got["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("rows_that_fit", [1, 2])
def test_an_attention_that_holds_every_score_takes_fewer_rows_at_once(model_and_tokenizer, monkeypatch, attention,
                                                                      rows_that_fit):
    model, tokenizer = model_and_tokenizer
    rows = conversations()
    longest = max(len(assistant_mask(tokenizer, r, 2048)[0]) for r in rows)
    monkeypatch.setattr(heldout, "SCORES_AT_ONCE", rows_that_fit * 4 * longest * longest)  # the model's 4 heads
    sizes = []
    monkeypatch.setattr(heldout, "batches", lambda lengths, size: sizes.append(size) or batches(lengths, size))
    loaded = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        got = heldout_loss(model, tokenizer, rows, max_length=2048, batch_size=3)
    finally:
        model.set_attn_implementation(loaded)
    assert sizes == [rows_that_fit if attention == "eager" else 3]
    assert got["loss"] == pytest.approx(reference_loss(model, tokenizer, rows, 2048)[0], rel=1e-5)
