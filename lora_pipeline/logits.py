"""How far one model's logits are from another's: merge's check of the merged model against the adapted one."""
from __future__ import annotations

import torch


def compare_logits(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """How far `other`'s logits [..., vocab] are from `reference`'s over the positions in `mask`: max and mean
    |difference|, the max relative to the largest |reference logit|, the mean relative to the mean |reference
    logit|, and how often the top-1 tokens agree."""
    ref, oth = reference.float(), other.float()
    if mask is not None:
        ref, oth = ref[mask.bool()], oth[mask.bool()]
    diff = (ref - oth).abs()
    largest = diff.max().item()
    return {"max_abs_logit_diff": largest, "mean_abs_logit_diff": diff.mean().item(),
            "relative_logit_diff": largest / ref.abs().max().item(),
            "mean_relative_logit_diff": diff.mean().item() / ref.abs().mean().item(),
            "top1_agreement": (ref.argmax(-1) == oth.argmax(-1)).float().mean().item()}
