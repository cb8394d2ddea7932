"""merge's weight check (lora_pipeline.merge.merged_checks) on a tiny bf16 gpt-oss whose router scores are nearly
tied: it passes correct merges and fails a lost adapter, a module left unmerged and a weight changed that no LoRA
adapts.
The logit rule merge used to gate on fails the correct merge of a trained adapter (rounding sends tokens to other
experts) and passes the loss of an adapter whose effect is below its tolerance."""
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from lora_pipeline.merge.merged_checks import (ADAPTER_FILE, BaseWeights, adapter_load_problem, check_merged_weights,
                                               compare_logits, lora_weights)
from lora_pipeline.model.loading import device, load_model
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint
from lora_pipeline.model.tiny import random_gpt_oss

VOCAB, HIDDEN, EXPERTS, TOP_K = 256, 64, 4, 2
MODEL = SimpleNamespace(dtype="bfloat16", attn_implementation="eager", experts_implementation="eager",
                        trust_remote_code=False)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def old_logit_rule(compared: dict, adapter_effect: float, dtype: str) -> str | None:
    """The rule merge gated on until the weight check (f9c31f1): the mean |merged - adapted| logit difference within
    a tolerance of the mean |logit|, or a tenth of the adapter's own effect."""
    relative = compared["mean_relative_logit_diff"]
    if relative <= {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}[dtype] or relative <= 0.1 * adapter_effect:
        return None
    return f"merged logits differ from the adapted model's by {relative:.3g} of the mean |logit|"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return near_tie_base(tmp_path_factory.mktemp("near-tie") / "base")


def near_tie_base(out):
    """A tiny gpt-oss in MXFP4, as openai/gpt-oss ships, whose routers score every expert alike but for a bias
    smaller than bf16's rounding of the scores: whether a token goes to the biased experts or, on a tie, to the others
    turns on the last bit of its score. The experts' outputs are scaled up so that a token sent elsewhere moves the
    logits a lot, as a trained expert would."""
    tie = set(torch.topk(torch.zeros(1, EXPERTS, dtype=torch.bfloat16), TOP_K).indices[0].tolist())
    biased = [e not in tie for e in range(EXPERTS)]  # these win unless rounding ties the scores
    model = random_gpt_oss(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.router
            # scores about 2, where a bf16 step is 2**-6: a bias of 0.01 is rounded away for some tokens, not others
            router.weight.copy_((torch.randn(HIDDEN, generator=generator) / 8 ** 0.5).expand(EXPERTS, HIDDEN))
            router.bias.copy_(torch.tensor(biased, dtype=torch.float32) * 0.01)
            layer.mlp.experts.down_proj.mul_(torch.tensor([4.0 if b else -4.0 for b in biased])[:, None, None])
    save_mxfp4_checkpoint(model, out)
    return out


def make_adapter(base_dir, out, scale: float, **targets):
    """A LoRA over the base with its B matrices random (std `scale`), saved as the train stage saves one."""
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, **targets)
    model = get_peft_model(load_model(base_dir, MODEL), config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out)
    return out


def merged(base_dir, adapter_dir, lose_adapter=False):
    """As the merge stage does it, on the GPU where there is one: the adapted model's and the base's logits on a few
    rows, then the merged model (merge_and_unload; with lose_adapter, unload: the base's weights as they were) and its
    logits."""
    ids = torch.randint(VOCAB, (4, 64), generator=torch.Generator().manual_seed(2)).to(device())
    model = PeftModel.from_pretrained(load_model(base_dir, MODEL, device_map={"": device()}), adapter_dir).eval()
    layers = lora_weights(model)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits.float()
        with model.disable_adapter():
            base = model(input_ids=ids).logits.float()
        result = model.unload() if lose_adapter else model.merge_and_unload()
        logits = result(input_ids=ids).logits.float()
    effect = compare_logits(adapted, base)["mean_relative_logit_diff"]
    return SimpleNamespace(model=result, layers=layers, compared=compare_logits(adapted, logits), effect=effect,
                           old_rule=old_logit_rule(compare_logits(adapted, logits), effect, "bfloat16"))


@pytest.fixture(scope="module")
def trained(base_dir):
    """An adapter on every linear layer and on the experts, whose effect on the logits is of the order of the
    logits (as after a real training)."""
    return make_adapter(base_dir, base_dir.parent / "trained", 0.02, target_modules="all-linear",
                        target_parameters=EXPERT_PARAMS)


@pytest.fixture(scope="module")
def slight(base_dir):
    """An adapter on lm_head, after every router, that moves the logits by less than the old rule's tolerance while
    its delta still exceeds bf16's rounding of most of lm_head's weights."""
    return make_adapter(base_dir, base_dir.parent / "slight", 1e-3, target_modules=["lm_head"])


def test_the_old_rule_fails_a_correct_merge_that_the_weight_check_passes(base_dir, trained):
    merge = merged(base_dir, trained)
    print(f"trained adapter, correct merge: logits {merge.compared}, adapter effect {merge.effect:.3g}")
    assert merge.compared["top1_agreement"] < 1  # rounding sent tokens to other experts
    assert merge.old_rule is not None, merge.compared
    check = check_merged_weights(merge.model, merge.layers, base_dir, trained)
    print(f"weights: {check.figures()}")
    assert check.problem is None
    assert check.adapted == len(merge.layers) > 0 and check.unchanged > 0
    assert {name.rsplit(".", 1)[-1] for name in merge.layers} >= {"gate_up_proj", "down_proj", "weight"}
    assert check.max_error_over_bound <= 1 and check.delta_above_rounding > 0.5
    assert check.delta_kept == pytest.approx(1, abs=0.01)


def test_the_old_rule_passes_a_lost_adapter_that_the_weight_check_fails(base_dir, slight):
    lost = merged(base_dir, slight, lose_adapter=True)
    print(f"slight adapter, lost: logits {lost.compared}, adapter effect {lost.effect:.3g}")
    assert lost.old_rule is None
    check = check_merged_weights(lost.model, lost.layers, base_dir, slight)
    print(f"weights: {check.figures()}")
    assert check.problem and "lm_head.weight" in check.problem and "holds 0.0% of the delta" in check.problem
    assert check.delta_kept == 0
    correct = merged(base_dir, slight)
    assert check_merged_weights(correct.model, correct.layers, base_dir, slight).problem is None


def test_a_lost_trained_adapter_fails_naming_every_weight(base_dir, trained):
    lost = merged(base_dir, trained, lose_adapter=True)
    check = check_merged_weights(lost.model, lost.layers, base_dir, trained)
    assert check.problem and f"{len(lost.layers) - 1} other adapted weights fail too" in check.problem
    assert check.delta_kept == 0 and check.max_error_over_bound > 1


def test_a_module_left_unmerged_or_a_weight_changed_fails_naming_it(base_dir, trained):
    merge = merged(base_dir, trained)
    name = "model.layers.1.mlp.experts.down_proj"
    weight = merge.model.get_parameter(name)
    with torch.no_grad():
        saved = weight.clone()
        weight.copy_(load_model(base_dir, MODEL).get_parameter(name))  # this one as the base has it
        check = check_merged_weights(merge.model, merge.layers, base_dir, trained)
        assert check.problem and check.problem.startswith(name) and "times the bound" in check.problem
        weight.copy_(saved)
        bias = merge.model.get_parameter("model.layers.0.mlp.router.bias")
        bias[0] = torch.nextafter(bias[0], torch.ones_like(bias[0]))  # one bf16 step
    check = check_merged_weights(merge.model, merge.layers, base_dir, trained)
    assert check.problem and check.problem.startswith("model.layers.0.mlp.router.bias differs from the base's in 1")


def test_an_adapter_file_the_model_did_not_load_is_named(base_dir, trained, tmp_path):
    stored = load_file(trained / ADAPTER_FILE)
    key = next(k for k in stored if "q_proj.lora_B" in k)
    stored[key.replace("q_proj", "q_projection")] = stored.pop(key)  # peft warns, and keeps that B at zero
    (tmp_path / "adapter_config.json").write_bytes((trained / "adapter_config.json").read_bytes())
    save_file(stored, tmp_path / ADAPTER_FILE)
    model = PeftModel.from_pretrained(load_model(base_dir, MODEL), tmp_path)
    problem = adapter_load_problem(model, tmp_path)
    assert problem and "q_projection" in problem and "not loaded" in problem
    assert adapter_load_problem(PeftModel.from_pretrained(load_model(base_dir, MODEL), trained), trained) is None


def test_base_weights_are_read_as_the_model_loads_them(base_dir):
    """Value for value, MXFP4 experts included (transformers' decoder and ours), on the stage's device."""
    import contextlib

    model = load_model(base_dir, MODEL, device_map={"": device()})
    with contextlib.ExitStack() as stack:
        base = BaseWeights(base_dir, stack)
        for name, tensor in model.state_dict().items():
            if name in base:
                assert torch.equal(base.rows(name, 1, 3, tensor), tensor[1:3]), name
