"""Greedy decoding whose one-token step is captured once as a CUDA graph (torch.cuda.graph) and replayed for every
later token, into a static KV cache, with no compiler (eval.decode_step: captured)."""
from __future__ import annotations

import torch
from transformers import GenerationConfig, StaticCache
from transformers.cache_utils import StaticLayer

from lora_pipeline.families.gpt_oss import sink_attention
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
# A step's full-attention layers read the cache up to the end of the block of this many slots that it writes in, not
# to the end of the cache: a graph is recorded for each block the decoding reaches, and the average step reads the
# prompt and half the new tokens instead of all of them.
READ_BLOCK = 128
# The prompts' pass runs in this many groups of rows of similar length, each padded to its own longest prompt: one
# batch padded to its longest prompt is mostly padding where the lengths vary (gpt-oss-20b's evaluation prompts: two
# thirds of the tokens).
PREFILL_GROUPS = 4


class BoundedLayer(StaticLayer):
    """transformers' static cache layer that gives attention its first `read_upto` slots (all of them where None):
    the slots past the newest token are masked anyway."""

    read_upto: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.read_upto is None:
            return keys, values
        return keys[:, :, :self.read_upto], values[:, :, :self.read_upto]


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
                    pad_token_id: int, capture: bool = True, read_block: int | None = None,
                    prefill_groups: int | None = None) -> torch.Tensor:
    """The new tokens [rows, up to max_new_tokens] of greedy decoding after left-padded prompts, as transformers'
    generate gives them: pad_token_id after a row's end of sequence, and up to CHECK_FINISHED_EVERY columns of it after
    every row has ended. The prompts run through the model as generate runs them, in `prefill_groups`
    (PREFILL_GROUPS) groups of rows (prefill); each later token is one step of the model on a static cache
    (window_cache.WindowCache where the model has sliding-window layers: pad the prompts to at least the window),
    under masks of the cache slots each row has filled. `capture`: record the step as a CUDA graph,
    once for each block of `read_block` (READ_BLOCK) cache slots, and replay it (on a GPU); without, the same step runs
    eagerly (the CPU's check of its arithmetic)."""
    rows, width = input_ids.shape
    device, slots, window = input_ids.device, width + max_new_tokens, sliding_window(model.config)
    if window and width < window:
        raise ValueError(f"the captured decode step needs prompts padded to the sliding window ({window} tokens): "
                         f"got {width}")
    cache = static_cache(model.config, slots)
    cache.layers = [BoundedLayer(max_cache_len=slots) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    bounded = [layer for layer in cache.layers if isinstance(layer, BoundedLayer)]
    positions = attention_mask.long().cumsum(-1) - 1
    positions.masked_fill_(attention_mask == 0, 1)  # generate's position ids for left padding
    logits = prefill(model, input_ids, attention_mask, positions, cache, groups=prefill_groups or PREFILL_GROUPS)

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
    windows = [layer for layer in cache.layers if isinstance(layer, FullWindowLayer)]
    if windows:
        # After the prompt a window layer holds the last `held` prompt tokens, oldest first (slots width - held to
        # width - 1); from then on it is a ring: slot s goes to index (s - width) % held.
        held = windows[0].max_cache_len
        ring_index, ring_offsets = torch.zeros(1, dtype=torch.long, device=device), torch.arange(held, device=device)
        for layer in windows:
            layer.ring = ring_index

    def as_mask(allowed):
        return (torch.where(allowed, 0.0, blocked).to(model.dtype) if additive else allowed)[:, None, None, :]

    def step():
        upto = bounded[0].read_upto if bounded else slots
        filled.logical_or_(slot_ids == slot)
        masks = {"full_attention": as_mask(filled[:, :upto])}
        if windows:
            ring_index.copy_(torch.remainder(slot - width, held).view(1))
            masks["sliding_attention"] = as_mask(filled[:, slot - torch.remainder(slot - width - ring_offsets, held)])
        logits = model(input_ids=token, attention_mask=masks, position_ids=position, cache=cache,
                       use_cache=True).logits[:, -1]
        chosen = torch.where(ended, pad, logits.argmax(-1))
        ended.logical_or_(torch.isin(chosen, stops))
        new.index_copy_(1, column, chosen[:, None])
        token.copy_(chosen[:, None])
        for counter in (position, slot, column):
            counter.add_(1)

    graphs, block = {}, read_block or READ_BLOCK  # read limit -> the step recorded with it
    columns = max_new_tokens
    for done in range(1, max_new_tokens):  # the step that fills column `done`, writing cache slot width + done - 1
        if done % CHECK_FINISHED_EVERY == 0 and bool(ended.all()):
            columns = done
            break
        upto = min(slots, -(-(width + done) // block) * block)
        for layer in bounded:
            layer.read_upto = upto
        if not capture:
            step()
        elif upto in graphs:
            graphs[upto].replay()
        elif not graphs:  # the first step runs eagerly, the warm-up the recording asks for, then is recorded
            graphs[upto] = captured(step, device)
        else:
            graphs[upto] = recorded(step, pool=next(iter(graphs.values())).pool())
            graphs[upto].replay()
    return new[:, :columns]


def static_cache(config, length: int) -> StaticCache:
    """transformers' static cache of `length` slots, WindowCache where the model has sliding-window layers."""
    return (WindowCache if sliding_window(config) else StaticCache)(config=config, max_cache_len=length)


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, cache,
            groups: int) -> torch.Tensor:
    """The prompts' pass into `cache`, which it leaves as one pass of the whole batch would: the logits of each row's
    last position [rows, vocab]. The rows go through the model in `groups` groups of similar prompt length, each cut to
    its longest prompt (at least the sliding window) and passed into a cache of its own, whose keys and values are then
    copied to the rows' last slots of `cache`: each row's tokens see the same keys, and no position computes padding
    that a shorter group can leave out."""
    rows, width = input_ids.shape
    window = sliding_window(model.config) or 0
    lengths = attention_mask.sum(-1)
    logits = None
    for group in torch.tensor_split(torch.argsort(lengths, stable=True), min(groups, rows)):
        wide = min(width, max(int(lengths[group].max()), window, 1))
        part = static_cache(model.config, wide)
        last = model(input_ids=input_ids[group, -wide:], attention_mask=attention_mask[group, -wide:],
                     position_ids=positions[group, -wide:], cache=part, use_cache=True, logits_to_keep=1).logits[:, -1]
        logits = last.new_empty(rows, last.shape[-1]) if logits is None else logits
        logits[group] = last
        for into, layer in zip(cache.layers, part.layers):
            if not into.is_initialized:
                into.lazy_initialization(layer.keys[:1].expand(rows, -1, -1, -1),
                                         layer.values[:1].expand(rows, -1, -1, -1))
            if isinstance(into, FullWindowLayer):  # the last `window` tokens, oldest first, as a whole pass leaves them
                into.keys[group], into.values[group] = layer.keys, layer.values
            else:  # the prompt's slots
                into.keys[group, :, width - wide:width] = layer.keys
                into.values[group, :, width - wide:width] = layer.values
    for layer in cache.layers:  # the counts one pass of `width` tokens leaves
        if isinstance(layer, FullWindowLayer):
            layer.cumulative_length_int, layer.full = width, True
        else:
            layer.cumulative_length.fill_(width)
    return logits


def captured(step, device) -> torch.cuda.CUDAGraph:
    """Run `step` once (on a side stream: the warm-up torch.cuda.graph asks for), then record it as a CUDA graph,
    which runs nothing; returns the graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    return recorded(step)


def recorded(step, pool=None) -> torch.cuda.CUDAGraph:
    """`step` recorded as a CUDA graph (which runs nothing), in the memory `pool` of an earlier graph where given:
    the graphs of one decoding run one after another, never at once."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            step()
    except RuntimeError as error:
        raise RuntimeError(f"eval.decode_step: captured: the model's decode step could not be recorded as a CUDA "
                           f"graph ({error}); use eval.decode_step: cudagraphs or eager") from error
    return graph
