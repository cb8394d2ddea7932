"""A static KV cache whose sliding-window layers keep their length out of the compiled decode step, so a model with
sliding-window layers (gpt-oss) decodes as one CUDA graph a step."""
from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, or None where it has none."""
    return config.sliding_window if "sliding_attention" in (getattr(config, "layer_types", None) or []) else None


class FullWindowLayer(StaticSlidingWindowLayer):
    """transformers' static sliding-window layer, whose decode step reads no Python int once the prompt has filled
    the window. The stock layer counts its tokens in a Python int that each step reads and increments: the compiled
    step takes it as an input, and a CUDA graph is recorded again for each of its values, once a token. Here a step
    of one token after a full prefill only rolls the window and writes the token, as the stock layer does once full;
    WindowCache.get_mask_sizes, which generate calls once a step outside the compiled step, advances the count."""

    full = False  # the prefill filled the window: each one-token step rolls it (or writes its ring, below)
    # Where set (the captured decode step sets it), a one-token step on a full window writes its token at this index
    # [1] and rolls nothing: the window is a ring, its oldest token overwritten in place, and the step's mask says
    # which slot holds which token (attention does not depend on the order of the keys).
    ring: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # The newest slot's index as a tensor (see the stock layer), made once with the cache: a CUDA graph being
        # recorded cannot copy one to the GPU each step. Static, as the stock layer marks its keys and values.
        self.last = torch.tensor([-1], dtype=torch.long, device=self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.last)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] == 1 and self.full:
            if self.ring is not None:
                self.keys.index_copy_(2, self.ring, key_states)
                self.values.index_copy_(2, self.ring, value_states)
                return self.keys, self.values
            keys, values = self.keys.roll(-1, dims=-2), self.values.roll(-1, dims=-2)
            keys[:, :, self.last] = key_states
            values[:, :, self.last] = value_states
            self.keys.copy_(keys)  # in place: the compiled step's inputs keep their addresses
            self.values.copy_(values)
            return self.keys, self.values
        states = super().update(key_states, value_states, *args, **kwargs)
        self.full = self.cumulative_length_int >= self.max_cache_len
        return states

    def reset(self):
        super().reset()
        self.full, self.ring = False, None


class WindowCache(StaticCache):
    """StaticCache with FullWindowLayer for the sliding-window layers. Decode only after a prompt at least as wide as
    the window (pad it so): a one-token step before the window is full takes the stock path, which compiles again
    for every token."""

    def __init__(self, config, max_cache_len: int):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.layers = [FullWindowLayer(max_cache_len=max_cache_len, sliding_window=layer.max_cache_len)
                       if isinstance(layer, StaticSlidingWindowLayer) else layer for layer in self.layers]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The stock sizes; for the one-token step about to run on full windows, every window's count advances here,
        outside the compiled step (generate asks once a step, before it)."""
        sizes = super().get_mask_sizes(query_length, layer_idx)
        layer = self.layers[layer_idx]
        if query_length == 1 and isinstance(layer, FullWindowLayer) and layer.full:
            for window in self.layers:
                if isinstance(window, FullWindowLayer):
                    window.cumulative_length_int += 1
        return sizes

    def check_counts(self) -> None:
        """Raise unless every window counts the tokens the full-attention layers hold: a count that left them (if
        generate asked for the mask sizes other than once a step) would have masked the wrong tokens."""
        full = [layer for layer in self.layers
                if not isinstance(layer, StaticSlidingWindowLayer) and layer.is_initialized]
        counts = {window.cumulative_length_int for window in self.layers if isinstance(window, FullWindowLayer)}
        if not (full and counts):
            return
        held = int(full[0].cumulative_length)  # one read of the device's count
        if counts != {held}:
            raise RuntimeError(f"WindowCache: the window layers count {sorted(counts)} tokens, the full-attention "
                               f"layers hold {held}: this transformers version asks for the mask sizes other than "
                               "once a decode step; use eval.decode_step: eager")
