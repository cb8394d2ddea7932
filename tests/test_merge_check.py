"""merge's check of the merged model: within rounding of the adapted model's logits, or far closer to them than the
base model is (a mixture of experts in 16 bits); a lost or doubled adapter fails, naming the figures."""
import torch

from lora_pipeline.logits import compare_logits
from stages.merge import merge_problem


def logits(seed=0):
    return torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_few_positions_routed_elsewhere_pass():
    adapted = logits()
    merged = adapted.clone()
    merged[0, 3] = logits(1)[0, 3]  # a token sent to other experts: that position's logits are others
    compared = compare_logits(adapted, merged)
    assert compared["relative_logit_diff"] > 0.5  # the largest difference alone would fail it
    assert merge_problem(compared, adapter_effect=0.5, dtype="bfloat16") is None


def test_noise_far_below_the_adapters_effect_passes():
    adapted = logits()
    merged = adapted + 0.05 * logits(2)  # 5 % of the mean |logit|, past the rounding tolerance
    compared = compare_logits(adapted, merged)
    assert compared["mean_relative_logit_diff"] > 0.04
    assert merge_problem(compared, adapter_effect=0.6, dtype="bfloat16") is None
    assert merge_problem(compared, adapter_effect=0.05, dtype="bfloat16") is not None


def test_a_lost_or_doubled_adapter_fails_naming_the_figures():
    base, adapted = logits(3), logits()
    doubled = adapted + (adapted - base)
    effect = compare_logits(adapted, base)["mean_relative_logit_diff"]
    for merged in (base, doubled):
        problem = merge_problem(compare_logits(adapted, merged), effect, "bfloat16")
        assert problem and "the adapter itself moves them by" in problem and "top-1 tokens agree" in problem


def test_float32_tolerance_is_tight():
    adapted = logits()
    compared = compare_logits(adapted, adapted + 1e-3)
    assert merge_problem(compared, adapter_effect=1e-3, dtype="bfloat16") is None
    assert merge_problem(compared, adapter_effect=1e-3, dtype="float32") is not None
