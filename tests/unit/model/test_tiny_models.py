"""The tiny base's pretraining texts: a long row is cut before it is tokenized, to the same first tokens, and each
text is tokenized once."""
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.model.tiny import cut_to_tokens, pretrain, pretraining_corpus, tokenizer_corpus, train_tokenizer

ROWS = builtin_data.generate(300, seed=4)
MAX_LENGTH = 128  # what pretrain cuts each text to


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-qwen2")
    train_tokenizer(tokenizer_corpus(ROWS), 1024, "tiny-qwen2", out)  # the default's vocabulary size
    return AutoTokenizer.from_pretrained(out)


def first_tokens(tokenizer, texts):
    """What pretrain feeds the model: each text with its end-of-text token, cut at MAX_LENGTH tokens."""
    batch = tokenizer([text + tokenizer.eos_token for text in texts], truncation=True, max_length=MAX_LENGTH)
    return batch["input_ids"]


def test_ordinary_texts_are_left_whole(tokenizer):
    texts = pretraining_corpus(ROWS)
    assert cut_to_tokens(texts, tokenizer, MAX_LENGTH) == texts


@pytest.mark.parametrize("long_text", [
    "\n".join(pretraining_corpus(ROWS)) * 4,  # prose, about 400,000 characters
    "Zahl" + "7" * 300_000,  # one run of digits
    "ä" * 150_000 + "Ende",  # two bytes a character
])
def test_a_long_text_is_cut_to_the_same_first_tokens(tokenizer, long_text):
    [cut] = cut_to_tokens([long_text], tokenizer, MAX_LENGTH)
    assert len(cut) < 10_000 < len(long_text)
    assert first_tokens(tokenizer, [cut]) == first_tokens(tokenizer, [long_text])
    assert len(first_tokens(tokenizer, [cut])[0]) == MAX_LENGTH


class CountingTokenizer:
    """The tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.characters = tokenizer, 0

    def __call__(self, texts, **kwargs):
        self.characters += sum(len(text) for text in texts)
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class Embedding(torch.nn.Module):
    """A stand-in model: pretrain needs only a loss that backpropagates."""

    def __init__(self, vocab_size):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 4)

    def forward(self, input_ids, attention_mask, labels):
        return SimpleNamespace(loss=self.embed(input_ids).pow(2).mean())


def test_pretraining_tokenizes_each_text_once_and_a_long_one_only_to_its_cut(tokenizer):
    texts = pretraining_corpus(ROWS[:20]) + ["Zahl" + "7" * 300_000]
    counting = CountingTokenizer(tokenizer)
    losses = pretrain(Embedding(len(tokenizer)), counting, texts, steps=30, seed=0, max_length=MAX_LENGTH)
    assert len(losses) == 30
    cut = cut_to_tokens(texts, tokenizer, MAX_LENGTH)
    assert counting.characters == sum(len(text + tokenizer.eos_token) for text in cut)  # 30 batches of 32, once each


@pytest.mark.parametrize("steps", [2, 3, 10, 14])
def test_a_few_pretraining_steps_warm_up_and_run_each_step(tokenizer, steps):
    """One-cycle divides by its warm-up's length in steps less one: a tenth of 10 steps divided by zero."""
    losses = pretrain(Embedding(len(tokenizer)), tokenizer, pretraining_corpus(ROWS[:20]), steps=steps, seed=0,
                      max_length=MAX_LENGTH)
    assert len(losses) == steps
