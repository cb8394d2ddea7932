"""gpt-oss's eager sink attention for decoding, the KV cache read in place, not copied per query head; a decode step's
in one fused kernel."""
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "grouped_sink_eager"


def for_model(model_type: str, attention: str) -> tuple[str, str | None]:
    """The attention evaluation runs for `attention` (inference_attention's choice), and why it differs: gpt-oss's
    eager attention runs as this module's, without copies of the keys and values per head: eager's arithmetic, but a
    decode step's in one fused kernel that sums in float32."""
    if model_type == "gpt_oss" and attention == "eager":
        return NAME, (f"gpt-oss's eager attention runs as {NAME} (no copy of the keys and values per head; a decode "
                      "step's in one fused kernel)")
    return attention, None


# Scores computed at once (rows x heads x queries x keys): a prefill into a static cache attends over the whole cache
# length, and 301 rows of gpt-oss-20b (64 heads) ran an 80 GB GPU out of memory in one piece; bigger passes go in
# chunks of queries.
SCORES_AT_ONCE = 2**30


def grouped_sink_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' gpt-oss eager attention (sinks included; inference: no dropout) with the query heads of each
    key/value head in one matmul, so the keys and values are read where the cache holds them. transformers' repeat_kv
    copies each layer's cache once per query head every step instead: for gpt-oss-20b's 64 query and 8 KV heads,
    8 copies of the whole cache. A decode step (one query a row) runs as attend_fused where FUSED_DECODE, and returns
    no weights. A pass of more than SCORES_AT_ONCE scores runs in chunks of queries and returns no weights either (as
    sdpa returns none): returning them would hold every score at once again."""
    batch, heads, q_len, _ = query.shape
    if q_len == 1 and FUSED_DECODE:
        return attend_fused(module, query, key, value, attention_mask, scaling), None
    chunk = max(1, SCORES_AT_ONCE // (batch * heads * key.shape[2]))
    if q_len <= chunk:
        return attend(module, query, key, value, attention_mask, scaling)
    outputs = [attend(module, query[:, :, start:start + chunk], key, value,
                      None if attention_mask is None else attention_mask[:, :, start:start + chunk], scaling)[0]
               for start in range(0, q_len, chunk)]
    return torch.cat(outputs, dim=1), None


def attend(module, query, key, value, attention_mask, scaling):
    """The attention of grouped_sink_attention for all of `query` at once: (output, weights)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query head h reads key/value head h // groups, as repeat_kv lays them out
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, dim), key.transpose(2, 3)) * scaling
    scores = scores.view(batch, kv_heads, groups, q_len, -1)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None]
    sinks = module.sinks.reshape(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, q_len, -1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    weights = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    out = torch.matmul(weights.reshape(batch, kv_heads, groups * q_len, -1), value)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), weights.reshape(batch, heads, q_len, -1)


# A decode step attends in one fused kernel (attend_fused) rather than in attend's matmuls and softmax, which write and
# read every score several times: the check scripts turn it off (fused_decode) to compare the two.
FUSED_DECODE = True


@contextmanager
def fused_decode(on: bool):
    """FUSED_DECODE set to `on` inside the block, and back after it."""
    global FUSED_DECODE
    before, FUSED_DECODE = FUSED_DECODE, on
    try:
        yield
    finally:
        FUSED_DECODE = before


def attend_fused(module, query, key, value, attention_mask, scaling):
    """The attention of one query a row (a decode step) in one fused kernel that returns each softmax's log-sum-exp:
    the query heads of a key/value head as that head's queries (one query a row attends with no causal mask, so
    they are independent), then the sinks: a sink adds exp(sink) to the softmax's denominator, which scales the
    output by sigmoid(logsumexp - sink). PyTorch's memory-efficient attention on a GPU, its flash attention on the
    CPU; the scores never leave the kernel."""
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups, dim)
    bias = None
    if attention_mask is not None:
        bias = attention_mask[:, :, :, :length]
        if length % 8:  # the kernel reads the bias in rows aligned to 8 elements: a slice of a wider one
            bias = torch.nn.functional.pad(bias, (0, 8 - length % 8))[..., :length]
        bias = bias.expand(batch, kv_heads, groups, length)
    if query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(grouped, key, value, bias, True,
                                                                          scale=scaling)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(grouped, key, value, attn_mask=bias,
                                                                              scale=scaling)
    wide = torch.promote_types(value.dtype, torch.float32)
    kept = torch.sigmoid(lse[..., :groups].to(wide) - module.sinks.to(wide).view(kv_heads, groups))
    return (out.to(wide) * kept[..., None]).to(value.dtype).reshape(batch, 1, heads, dim)


AttentionInterface.register(NAME, grouped_sink_attention)
AttentionMaskInterface.register(NAME, eager_mask)
