"""The held-out loss: next-token loss over the assistant tokens of held-out conversations, batched, over the
processes of a launch."""
from __future__ import annotations

import torch

from lora_pipeline.families.gpt_oss import sink_attention
from lora_pipeline.evaluate.generation import batches, evaluation_attention
from lora_pipeline.evaluate.scoring import loss_figures
from lora_pipeline.launch.distributed import gather, process_group
from lora_pipeline.model.loading import experts_implementation


def assistant_mask(tokenizer, messages: list[dict] | str, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a 0/1 mask of its assistant tokens (all ones if the template has no
    {% generation %} markers, as the real models' templates often do not, and for a text row, given as a string)."""
    if isinstance(messages, str):
        ids = tokenizer(messages)["input_ids"][:max_length]
        return ids, [1] * len(ids)
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    ids = list(encoded["input_ids"])[:max_length]
    mask = list(encoded.get("assistant_masks") or [])[:max_length]
    if not any(mask):
        mask = [1] * len(ids)
    return ids, mask


def use_for_loss(model) -> dict:
    """Switch a loaded model to the attention the held-out loss runs (generation.evaluation_attention); returns what
    runs."""
    attention, notes = evaluation_attention(model.config.model_type, model.config._attn_implementation)
    if attention != model.config._attn_implementation:
        model.set_attn_implementation(attention)
    return {"attention": attention, "experts": experts_implementation(model), "notes": notes}


# Logits held at once while computing the held-out loss (positions x vocabulary, float32): a 201k vocabulary makes a
# whole batch of 2,048-token rows tens of GiB.
LOGITS_AT_ONCE = 2**28
# Attention scores held at once by an attention that computes them all (rows x heads x width x width): gpt-oss-20b's
# 64 heads make one 2,048-token row 2**28 scores, 0.5 GiB in bfloat16, and eager attention holds a few such tensors.
SCORES_AT_ONCE = 2**31
SCORING_ATTENTIONS = ("eager", sink_attention.NAME)


def rows_at_once(model, lengths: list[int], batch_size: int) -> int:
    """Rows in one batch of the loss: batch_size, fewer where the attention computes every score (eager), so that
    a batch of the longest rows holds at most SCORES_AT_ONCE of them."""
    if model.config._attn_implementation not in SCORING_ATTENTIONS or not lengths:
        return batch_size
    longest = max(lengths)
    return max(1, min(batch_size, SCORES_AT_ONCE // (model.config.num_attention_heads * longest * longest)))


@torch.no_grad()
def heldout_loss(model, tokenizer, conversations: list[list[dict]], max_length: int, batch_size: int) -> dict:
    """Mean next-token loss over the assistant tokens of held-out conversations, and its perplexity. Rows go through
    the model in batches of similar length (generation.batches, rows_at_once rows each); the LM head runs only on the
    positions that predict an assistant token, as many at a time as LOGITS_AT_ONCE allows. In a launch of several
    processes each takes every n-th batch and the sums are added in batch order, as one process adds them."""
    rank, world = process_group()
    encoded = [assistant_mask(tokenizer, c, max_length) for c in conversations]
    positions_at_once = max(1, LOGITS_AT_ONCE // model.config.vocab_size)
    sums = []
    lengths = [len(ids) for ids, _ in encoded]
    for index, batch in list(enumerate(batches(lengths, rows_at_once(model, lengths, batch_size))))[rank::world]:
        chunk = [encoded[i] for i in batch]
        width = max(len(ids) for ids, _ in chunk)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in chunk], device=model.device)
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chunk], device=model.device)
        labels_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in chunk], device=model.device)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
        keep = labels_mask[:, 1:].bool() & attention[:, 1:].bool()
        predicting, targets = hidden[:, :-1][keep], ids[:, 1:][keep]  # [positions, hidden], [positions]
        total = torch.zeros((), dtype=torch.float64, device=model.device)
        for first in range(0, len(targets), positions_at_once):
            logits = model.get_output_embeddings()(predicting[first:first + positions_at_once]).float()
            total += torch.nn.functional.cross_entropy(logits, targets[first:first + positions_at_once],
                                                       reduction="sum")
        sums.append((index, total.item(), len(targets)))
    total, count = 0.0, 0
    for _, batch_total, batch_count in sorted(gather(sums)):
        total += batch_total
        count += batch_count
    return loss_figures(total, count)
