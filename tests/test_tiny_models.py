"""The tiny base's pretraining texts: a long row is cut before it is tokenized, to the same first tokens."""
import pytest
from transformers import AutoTokenizer

from lora_pipeline import builtin_data
from lora_pipeline.tiny_models import cut_to_tokens, pretraining_corpus, tokenizer_corpus, train_tokenizer

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
