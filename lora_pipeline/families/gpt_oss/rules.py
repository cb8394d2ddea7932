"""What gpt-oss alone allows: its frozen experts kept in MXFP4 while training (grouped_mm_mxfp4) and its merged
model saved in MXFP4; each rule returns why not, naming the params key and the way on."""
from __future__ import annotations

# gpt-oss's frozen experts kept in MXFP4 while training (mxfp4_experts): loaded as grouped_mm, the
# same arithmetic on the 16-bit experts, and packed by the train stage after loading.
MXFP4_EXPERTS = "grouped_mm_mxfp4"
PACKED = ("gate_up_proj", "down_proj")  # the expert weights it packs; their biases stay in the model dtype


def packing_problems(model_type: str | None, stored: str | None, target_parameters) -> list[str]:
    """Why model.experts_implementation grouped_mm_mxfp4 cannot be used with this base and these LoRA targets, one
    line each ([] if it can). model_type: the base's, None where not known yet; stored: the quant_method its
    checkpoint declares ("none" for plain weights), None where not known."""
    key, problems = f"model.experts_implementation: {MXFP4_EXPERTS}", []
    if model_type is not None and model_type != "gpt_oss":
        problems.append(f"{key} keeps gpt-oss's frozen MoE experts in MXFP4, but the base model ({model_type}) is not "
                        "gpt-oss; allowed: eager, grouped_mm, batched_mm")
    elif stored is not None and stored != "mxfp4":
        problems.append(f"{key} re-encodes experts loaded from MXFP4, but the base model stores no MXFP4 weights (its "
                        "config.json declares no mxfp4 quantization_config); allowed: grouped_mm, or an MXFP4 "
                        "checkpoint (as openai/gpt-oss-20b ships) with quantization.method mxfp4-dequantize")
    trained = [t for t in target_parameters if t.rsplit(".", 1)[-1] in PACKED]
    if trained:
        problems.append(f"{key} freezes the experts in MXFP4, but lora.target_parameters {trained} trains them; "
                        "allowed: grouped_mm with these targets, or lora.target_parameters without the experts' "
                        f"{' / '.join(PACKED)}")
    return problems


def save_format_problem(save_format: str, model_type: str) -> str | None:
    """Why merge.save_format cannot be used with a base model of this type, or None."""
    if save_format == "mxfp4" and model_type != "gpt_oss":
        return (f"merge.save_format: mxfp4, but the base model ({model_type}) is not gpt-oss, whose MoE experts "
                "(mlp.experts.gate_up_proj / down_proj) are what MXFP4 stores; allowed: auto, model_dtype")
    return None
