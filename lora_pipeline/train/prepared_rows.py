"""The training rows as TRL prepares them, with assistant turns of weight 0 out of the loss and what the cut loses."""
from __future__ import annotations

import copy

import pyarrow.compute as pc
from datasets import Dataset
from trl import SFTTrainer

IGNORED = -100  # the label of a token TRL leaves out of the loss
# metrics/train.json's counts of what the cut at train.sft.max_length loses
LOST_KEYS = ("rows_truncated", "tokens_truncated", "rows_dropped_no_target")


def weight_zero_turns(dataset: Dataset) -> int:
    """How many messages of a {messages} data set carry weight 0 (OpenAI's per-turn weight: context, not a target)."""
    if "messages" not in dataset.column_names:
        return 0
    messages = pc.list_flatten(dataset.with_format("arrow")["messages"])
    if messages.type.get_field_index("weight") < 0:
        return 0
    return pc.sum(pc.equal(pc.struct_field(messages, "weight"), 0)).as_py() or 0


def trained_spans(labels: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of labelled tokens of a row, in order."""
    spans, start = [], None
    for i, label in enumerate([*labels, IGNORED]):
        if label != IGNORED and start is None:
            start = i
        elif label == IGNORED and start is not None:
            spans.append((start, i))
            start = None
    return spans


def without_weight_zero_turns(example: dict) -> dict:
    """The row's labels with its assistant turns of weight 0 left out of the loss: they stay in the sequence as
    context. With the assistant-only loss each assistant turn is one labelled run (the chat template's
    {% generation %} block), so the k-th run is the k-th assistant turn."""
    weights = [m.get("weight") for m in example["messages"] if m["role"] == "assistant"]
    labels = example["labels"]
    if 0 not in weights:
        return {"labels": labels}
    spans = trained_spans(labels)
    if len(spans) != len(weights):
        raise ValueError(f"a row has assistant turns of weight 0, but the chat template marks {len(spans)} trained "
                         f"spans for its {len(weights)} assistant turns: leaving a turn out of the loss needs one "
                         "{% generation %} block per assistant turn, with a token outside them between turns")
    labels = list(labels)
    for (start, end), weight in zip(spans, weights):
        if weight == 0:
            labels[start:end] = [IGNORED] * (end - start)
    return {"labels": labels}


def cut_losses(dataset: Dataset, max_length: int | None, truncation_mode: str, packing: bool,
               packing_strategy: str) -> dict:
    """What TRL's cut at max_length loses of whole tokenized rows: the rows longer than it, the tokens past it, and
    the rows left with no labelled token (TRL drops them; packed, they add nothing to the loss). Packing "bfd" cuts
    each row as keep_start does; "bfd_split" and "wrapped" split rows and lose nothing."""
    lost = dict.fromkeys(LOST_KEYS, 0)
    if max_length is None or (packing and packing_strategy != "bfd"):
        cut = slice(None)
    else:
        cut = slice(-max_length, None) if truncation_mode == "keep_end" and not packing else slice(None, max_length)
    for batch in dataset.select_columns(["labels"]).iter(batch_size=1024):
        for labels in batch["labels"]:
            kept = labels[cut]
            if len(kept) < len(labels):
                lost["rows_truncated"] += 1
                lost["tokens_truncated"] += len(labels) - len(kept)
            if all(label == IGNORED for label in kept):
                lost["rows_dropped_no_target"] += 1
    return lost


def lost_line(lost: dict, rows: int, max_length: int | None) -> str | None:
    """One line on what the cut loses (None when nothing): counts, the setting and how to keep them."""
    if not any(lost.values()):
        return None
    parts = []
    if lost["rows_truncated"]:
        parts.append(f"rows longer than train.sft.max_length ({max_length}), cut to it: {lost['rows_truncated']} of "
                     f"{rows} ({lost['tokens_truncated']} tokens cut off)")
    if lost["rows_dropped_no_target"]:
        parts.append(f"rows with no trained token left, not trained: {lost['rows_dropped_no_target']}")
    return (f"train: {'; '.join(parts)}. See metrics/train.json; raise train.sft.max_length in params.yaml to keep "
            "them (memory per step grows with it), or shorten those rows")


class PreparedRowsSFTTrainer(SFTTrainer):
    """SFTTrainer whose training rows go through TRL's own preparation in two passes: tokenized and labelled whole
    (no max_length, no packing), then cut, filtered and packed as TRL does in one. Between them, assistant turns of
    weight 0 lose their labels, and what the cut will lose is counted (`rows_lost`, LOST_KEYS)."""

    rows_lost = dict.fromkeys(LOST_KEYS, 0)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if dataset_name != "train" or not isinstance(dataset, Dataset):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        whole_args = copy.copy(args)
        whole_args.max_length, whole_args.shuffle_dataset = None, False
        whole = super()._prepare_dataset(dataset, processing_class, whole_args, False, formatting_func, dataset_name)
        if weight_zero_turns(whole):
            whole = whole.map(without_weight_zero_turns, num_proc=args.dataset_num_proc,
                              desc="Leaving assistant turns of weight 0 out of the loss")
        self.rows_lost = cut_losses(whole, args.max_length, args.truncation_mode, packing, args.packing_strategy)
        return super()._prepare_dataset(whole, processing_class, args, packing, None, dataset_name)
