"""The training rows as the train stage prepares them: TRL's own preparation in two passes, which gives what TRL gives
in one, assistant turns of weight 0 left out of the loss, and what the cut at max_length loses, counted."""
import pytest
import torch
import yaml
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import SFTTrainer

from cli.recipes import apply_sets
from lora_pipeline.config.params import ROOT, for_stage, validate
from lora_pipeline.model.chat import training_rows
from lora_pipeline.model.tiny import tokenizer_corpus, train_tokenizer
from lora_pipeline.train.prepared_rows import IGNORED, LOST_KEYS, lost_line, without_weight_zero_turns
from lora_pipeline.train.training import build_trainer

WORDS = ["river", "bridge", "city", "north", "south", "market", "tower", "garden", "harbour", "station"]


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def weighted_rows() -> list[dict]:
    """Two-turn conversations whose first answer is context (weight 0) and second a target (weight 1); one row
    without weights."""
    def row(i, weights):
        first, second = ({"weight": w} if w is not None else {} for w in weights)
        return {"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": f"Where is the {WORDS[i]}?"},
                             {"role": "assistant", "content": f"FIRSTANSWER {words(3, i)}", **first},
                             {"role": "user", "content": "And then?"},
                             {"role": "assistant", "content": f"SECONDANSWER {words(2, i + 5)}", **second}]}
    return [row(i, (0, 1)) for i in range(5)] + [row(5, (None, None))]


def chat_base(tmp_path, family: str, rows: list[dict]):
    """A tiny random Qwen2 with a BPE tokenizer trained on the rows and the family's chat template (TRL reads only the
    template and the tokens: a Qwen2 serves both families here)."""
    base = tmp_path / f"base-{family}"
    tok = train_tokenizer(tokenizer_corpus(rows), 300, family, base)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(base)
    return base


def chat_trainer(tmp_path, base, rows, sets=()):
    raw = apply_sets(yaml.safe_load((ROOT / "params.yaml").read_text()),
                     ["train.checkpoint_steps=0", "train.sft.max_steps=1", "train.sft.per_device_train_batch_size=4",
                      *sets])
    params = for_stage(validate(raw), "test", ["model", "quantization", "train", "lora"])
    return build_trainer(params, base, Dataset.from_list(training_rows(rows)), tmp_path / "out")[0]


def trained_text(trainer, row: dict) -> str:
    return trainer.processing_class.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORED])


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-gpt-oss"])
def test_a_turn_of_weight_zero_is_context_and_one_of_weight_one_is_trained(tmp_path, family):
    """Through SFTTrainer's preparation, assistant-only loss: an answer of weight 0 stays in the sequence with no
    label, one of weight 1 keeps its labels; every other token is labelled as without weights (the row without
    weights trains both answers)."""
    rows = weighted_rows()
    base = chat_base(tmp_path, family, rows)
    trainer = chat_trainer(tmp_path, base, rows)
    unweighted_rows = [{"messages": [{k: v for k, v in m.items() if k != "weight"} for m in row["messages"]]}
                       for row in rows]
    weighted, plain = trainer.train_dataset, chat_trainer(tmp_path, base, unweighted_rows).train_dataset
    assert "weight" not in plain[0]["messages"][0] and weighted[0]["messages"][2]["weight"] == 0
    decode = trainer.processing_class.decode
    for i, (row, reference) in enumerate(zip(weighted, plain)):
        assert row["input_ids"] == reference["input_ids"]
        assert "FIRSTANSWER" in decode(row["input_ids"])  # still there, as context
        text, reference_text = trained_text(trainer, row), trained_text(trainer, reference)
        assert "FIRSTANSWER" in reference_text and "SECONDANSWER" in reference_text
        assert "SECONDANSWER" in text and ("FIRSTANSWER" in text) == (i == len(rows) - 1), text
        unlabelled = decode([t for t, a, b in zip(row["input_ids"], row["labels"], reference["labels"]) if a != b])
        if i < len(rows) - 1:  # the first answer's turn alone, as the template's generation block renders it
            assert "FIRSTANSWER" in unlabelled and "SECONDANSWER" not in unlabelled, unlabelled
            assert "And then" not in unlabelled and "Where is" not in unlabelled, unlabelled
        else:
            assert unlabelled == ""


def test_weight_zero_without_the_assistant_only_loss_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import lora_pipeline.train.training as training

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the check")

    monkeypatch.setattr(training, "load_tokenizer", no_loading)
    with pytest.raises(SystemExit, match=r"^train: 5 assistant turns .* weight 0 .*assistant_only_loss: true in"):
        chat_trainer(tmp_path, tmp_path, weighted_rows(), ["train.sft.assistant_only_loss=false"])


def test_turns_the_template_does_not_mark_one_by_one_are_refused():
    messages = [{"role": "user"}, {"role": "assistant", "weight": 0}, {"role": "assistant", "weight": 1}]
    with pytest.raises(ValueError, match="marks 1 trained spans for its 2 assistant turns"):
        without_weight_zero_turns({"messages": messages, "labels": [IGNORED, 5, 6, 7]})
    labels = [IGNORED, 5, 6, IGNORED, 7, 8]
    assert without_weight_zero_turns({"messages": messages, "labels": labels})["labels"] == [IGNORED] * 4 + [7, 8]


def length_rows() -> list[dict]:
    """Short rows, rows whose answer runs past a 48-token cut and rows whose question alone does."""
    short = [{"messages": [{"role": "user", "content": f"Name a {WORDS[i]}."},
                           {"role": "assistant", "content": words(2, i)}]} for i in range(6)]
    long_answer = [{"messages": [{"role": "user", "content": "Describe the city."},
                                 {"role": "assistant", "content": words(60 + i, i)}]} for i in range(3)]
    long_question = [{"messages": [{"role": "user", "content": words(70 + i, i)},
                                   {"role": "assistant", "content": "Yes."}]} for i in range(2)]
    return short + long_answer + long_question


@pytest.mark.parametrize("sets", [[], ["train.sft.truncation_mode=keep_end"], ["train.sft.packing=true"],
                                  ["train.sft.padding_free=true"]], ids=["keep_start", "keep_end", "packing",
                                                                         "padding_free"])
def test_the_two_passes_give_what_trl_gives_in_one_and_count_what_the_cut_loses(tmp_path, sets):
    """The rows the trainer trains on are those TRL's one pass prepares, byte for byte; rows_lost counts the rows
    longer than max_length, the tokens past it, and the rows left with no trained token (TRL drops those; keep_end
    keeps every answer; packed, they stay and train nothing). Without a cut, nothing is lost."""
    rows = length_rows()
    base = chat_base(tmp_path, "tiny-qwen2", rows)
    trainer = chat_trainer(tmp_path, base, rows, ["train.sft.max_length=48", *sets])
    one_pass = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(training_rows(rows)), trainer.processing_class,
                                           trainer.args, trainer.args.packing, None, "train")
    columns = ["input_ids", "labels"] + (["seq_lengths"] if trainer.args.packing else [])
    assert trainer.train_dataset.select_columns(columns).to_dict() == one_pass.select_columns(columns).to_dict()

    lengths = [len(trainer.processing_class.apply_chat_template(row["messages"], tokenize=True,
                                                                return_dict=True)["input_ids"]) for row in rows]
    assert max(lengths[:6]) <= 48 < min(lengths[6:])
    keep_end = "keep_end" in str(sets)
    assert trainer.rows_lost == {"rows_truncated": 5, "tokens_truncated": sum(n - 48 for n in lengths[6:]),
                                 "rows_dropped_no_target": 0 if keep_end else 2}
    if not trainer.args.packing:
        assert len(trainer.train_dataset) == len(rows) - trainer.rows_lost["rows_dropped_no_target"]
    line = lost_line(trainer.rows_lost, len(rows), 48)
    assert line.startswith("train: rows longer than train.sft.max_length (48), cut to it: 5 of 11 (")
    assert ("no trained token left, not trained: 2" in line) != keep_end and "raise train.sft.max_length" in line

    uncut = chat_trainer(tmp_path, base, rows, ["train.sft.max_length=4096"])
    assert uncut.rows_lost == dict.fromkeys(LOST_KEYS, 0) and len(uncut.train_dataset) == len(rows)
    assert lost_line(uncut.rows_lost, len(rows), 4096) is None
