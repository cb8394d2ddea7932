"""Greedy decoding whose one-token step is captured once as a CUDA graph (torch.cuda.graph) and replayed for every
later token, into a static KV cache, with no compiler (eval.decode_step: captured)."""
from __future__ import annotations

import torch
from transformers import GenerationConfig, StaticCache

from lora_pipeline.evaluate import sink_attention
from lora_pipeline.evaluate.window_cache import FullWindowLayer, WindowCache, sliding_window

# Generation settings under which greedy decoding takes the plain argmax of the logits: any other value of these
# adds a logits processor to transformers' generate, which the captured step does not apply.
PLAIN_GREEDY = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "min_length", "min_new_tokens",
                "sequence_bias", "encoder_repetition_penalty", "exponential_decay_length_penalty", "num_beams",
                "renormalize_logits", "epsilon_cutoff", "eta_cutoff", "guidance_scale", "watermarking_config")
ADDITIVE = ("eager", sink_attention.NAME)  # attentions that add their mask to the scores; sdpa takes a boolean one
ATTENTION = ("sdpa", *ADDITIVE)
CHECK_FINISHED_EVERY = 16  # decode steps between the host's reads of whether every row has ended (each waits)


def unsupported(model) -> str | None:
    """Why the captured step cannot decode this model as generate would, or None where it can."""
    config = model.config
    if config._attn_implementation not in ATTENTION:
        return f"it takes {' or '.join(ATTENTION)} attention, not {config._attn_implementation}"
    stock, own = GenerationConfig(), model.generation_config
    changed = [name for name in PLAIN_GREEDY if getattr(own, name, None) != getattr(stock, name, None)]
    return f"the model's generation config sets {', '.join(changed)}" if changed else None


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    pad_token_id: int, capture: bool = True) -> torch.Tensor:
    """The new tokens [rows, up to max_new_tokens] of greedy decoding after left-padded prompts, as transformers'
    generate gives them: pad_token_id after a row's end of sequence, and up to CHECK_FINISHED_EVERY columns of it after
    every row has ended. The prompt runs through the model as generate runs it; each later token is one step of the
    model on a static cache (window_cache.WindowCache where the model has sliding-window layers: pad the prompts to at
    least the window), under masks of the cache slots each row has filled. `capture`: record the step once as a CUDA
    graph and replay it (on a GPU); without, the same step runs eagerly (the CPU's check of its arithmetic)."""
    rows, width = input_ids.shape
    device, slots, window = input_ids.device, width + max_new_tokens, sliding_window(model.config)
    if window and width < window:
        raise ValueError(f"the captured decode step needs prompts padded to the sliding window ({window} tokens): "
                         f"got {width}")
    cache = (WindowCache if window else StaticCache)(config=model.config, max_cache_len=slots)
    positions = attention_mask.long().cumsum(-1) - 1
    positions.masked_fill_(attention_mask == 0, 1)  # generate's position ids for left padding
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]

    # The step's state, all on the device, updated in place: a CUDA graph replays reads and writes of fixed addresses.
    filled = torch.zeros(rows, slots, dtype=torch.bool, device=device)
    filled[:, :width] = attention_mask.bool()
    slot_ids = torch.arange(slots, device=device)
    slot = torch.tensor(width, device=device)  # the cache slot the next step writes
    column = torch.tensor(1, device=device)  # the output column the next step fills
    position = positions[:, -1:] + 1
    pad, stops = torch.tensor(pad_token_id, device=device), torch.tensor(eos_ids(model) or [-1], device=device)
    new = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    token = logits.argmax(-1, keepdim=True)
    new[:, :1] = token
    ended = torch.isin(token[:, 0], stops)
    additive, blocked = model.config._attn_implementation in ADDITIVE, torch.finfo(model.dtype).min
    # A window layer holds its last `held` tokens, oldest first: the slots from the one written this step back.
    held = next(layer.max_cache_len for layer in cache.layers if isinstance(layer, FullWindowLayer)) if window else 0
    window_slots = torch.arange(1 - held, 1, device=device) if window else None

    def as_mask(allowed):
        return (torch.where(allowed, 0.0, blocked).to(model.dtype) if additive else allowed)[:, None, None, :]

    def step():
        filled.logical_or_(slot_ids == slot)
        masks = {"full_attention": as_mask(filled)}
        if window:
            masks["sliding_attention"] = as_mask(filled[:, slot + window_slots])
        logits = model(input_ids=token, attention_mask=masks, position_ids=position, cache=cache,
                       use_cache=True).logits[:, -1]
        chosen = torch.where(ended, pad, logits.argmax(-1))
        ended.logical_or_(torch.isin(chosen, stops))
        new.index_copy_(1, column, chosen[:, None])
        token.copy_(chosen[:, None])
        for counter in (position, slot, column):
            counter.add_(1)

    replay = captured(step, device) if capture and max_new_tokens > 1 else step  # its warm-up is the first step
    columns = max_new_tokens
    for done in range(2 if replay is not step else 1, max_new_tokens):
        if done % CHECK_FINISHED_EVERY == 0 and bool(ended.all()):
            columns = done
            break
        replay()
    return new[:, :columns]


def captured(step, device) -> callable:
    """Run `step` once (on a side stream: the warm-up torch.cuda.graph asks for), then record it as a CUDA graph,
    which runs nothing; returns the graph's replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as error:
        raise RuntimeError(f"eval.decode_step: captured: the model's decode step could not be recorded as a CUDA "
                           f"graph ({error}); use eval.decode_step: cudagraphs or eager") from error
    return graph.replay
