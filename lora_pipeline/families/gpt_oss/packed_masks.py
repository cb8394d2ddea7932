"""gpt-oss's attention masks for padding-free (or packed) rows, which its model builds without the position_ids."""
from __future__ import annotations

import torch


def mask_packed_rows(model) -> str | None:
    """Make gpt-oss's eager, sdpa and flex attention keep the rows of a padding-free (or packed) batch apart, and say
    so (None where nothing needed it). transformers' gpt-oss builds its masks without the position_ids (Qwen2 passes
    them; transformers PR #39997 is open), so each row there attends to the rows packed before it. A hook on the
    decoder builds the two masks as transformers' own mask functions do from the position_ids: a new sequence
    wherever they do not count up by one. torch_varlen and flash attention read the bounds themselves."""
    attention = model.config._attn_implementation
    if model.config.model_type != "gpt_oss" or attention not in ("eager", "sdpa", "flex_attention"):
        return None
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = model.get_decoder()

    def packed_masks(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        rows = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        if position_ids is None or rows is None or kwargs.get("attention_mask") is not None or past is not None:
            return None  # padded rows (their mask given) and decoding: the model's own masks are right
        # the mask functions read only the shape, dtype and device of the embeddings
        shape = torch.empty(*rows.shape[:2], 0, dtype=module.embed_tokens.weight.dtype, device=position_ids.device)
        mask_kwargs = {"config": module.config, "inputs_embeds": shape, "attention_mask": None, "cache": None,
                       "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**mask_kwargs),
                 "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs)}
        return args, {**kwargs, "attention_mask": masks}

    decoder.register_forward_pre_hook(packed_masks, with_kwargs=True)
    return f"{attention}: masks from the position_ids (gpt-oss builds them without)"
