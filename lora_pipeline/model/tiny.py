"""Tiny base models of the real architectures (Qwen2, gpt-oss) with a locally trained BPE; gpt-oss-20b's config."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, decoders, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lora_pipeline.model.chat import (CHATML_SPECIAL_TOKENS, CHATML_THINK_TEMPLATE, CHATML_TOOLS_TEMPLATE,
                                      HARMONY_SPECIAL_TOKENS, HARMONY_TEMPLATE, HARMONY_TOOLS_TEMPLATE, uses_tools)
from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK

# Qwen2Tokenizer rebuilds its pre-tokenizer from this regex whatever tokenizer.json says, so the BPE is
# trained with exactly that pipeline (NFC, the regex split, byte level without its own regex).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

FAMILIES = {
    "tiny-qwen2": dict(template=CHATML_THINK_TEMPLATE, tools_template=CHATML_TOOLS_TEMPLATE,
                       special=CHATML_SPECIAL_TOKENS, tokenizer_class="Qwen2Tokenizer",
                       eos=["<|im_end|>", "<|endoftext|>"], pad="<|endoftext|>"),
    "tiny-gpt-oss": dict(template=HARMONY_TEMPLATE, tools_template=HARMONY_TOOLS_TEMPLATE,
                         special=HARMONY_SPECIAL_TOKENS, tokenizer_class="PreTrainedTokenizerFast",
                         eos=["<|return|>", "<|end|>"], pad="<|endoftext|>"),
}

# Bounds on what the tiny BPE trains on, so that no row can stall fetch: training time grows with the square of a
# word's length. The built-in data never reaches them (texts of at most a few hundred characters, under a million in
# all; its longest token is 13 characters), so the default's tokenizer is the same with or without them.
TOKENIZER_TEXT_CHARS = 4_000  # the first characters of each text
TOKENIZER_CORPUS_CHARS = 8_000_000  # the first characters of all texts together
TOKEN_CHARS = 64  # the longest token it may build: what pretrain's cut_to_tokens keeps of a text grows with it


def train_tokenizer(texts: list[str], vocab_size: int, family: str, out_dir: Path, tools: bool = False,
                    max_token_length: int | None = None):
    """Train a byte-level BPE on `texts` (tokens of at most max_token_length characters), save it with the family's
    chat template (the one that renders tools, for data that holds them), and load it back."""
    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=max_token_length)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"][0], pad_token=spec["pad"],
                                   unk_token=None, additional_special_tokens=spec["special"])
    fast.chat_template = spec["tools_template" if tools else "template"]
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = spec["tokenizer_class"]
    config_path.write_text(json.dumps(config, indent=2))
    return fast


def tiny_qwen2(tokenizer, tiny):
    """A randomly initialised Qwen2ForCausalLM of the given sizes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(tiny.seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                         intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
                         num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
                         max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=True,
                         initializer_range=tiny.initializer_range, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


def tiny_gpt_oss(tokenizer, tiny):
    """A randomly initialised GptOssForCausalLM (bf16) of the given sizes."""
    return random_gpt_oss(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                          intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
                          num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
                          head_dim=tiny.hidden_size // tiny.num_attention_heads,
                          num_local_experts=tiny.num_local_experts, num_experts_per_tok=tiny.num_experts_per_tok,
                          max_position_embeddings=tiny.max_position_embeddings, seed=tiny.seed,
                          initializer_range=tiny.initializer_range,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def random_gpt_oss(
    *,
    vocab_size: int,
    hidden_size: int = 64,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    num_local_experts: int = 4,
    num_experts_per_tok: int = 2,
    sliding_window: int = 32,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    bos_token_id: int | None = None,
    initializer_range: float = 0.02,
):
    """A randomly initialised (torch.manual_seed(seed)) GptOssForCausalLM in bf16.

    The real architecture in bf16: layer_types alternating sliding/full attention as the real config does, YaRN rope
    with factor 32. hidden_size and intermediate_size must be multiples of 32 (ValueError naming the param otherwise).
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    for pname, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not isinstance(value, int) or value <= 0 or value % MXFP4_BLOCK != 0:
            raise ValueError(f"{pname} must be a positive multiple of {MXFP4_BLOCK} for MXFP4, got {value!r}")
    positive = {
        "vocab_size": vocab_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "num_local_experts": num_local_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "sliding_window": sliding_window,
        "max_position_embeddings": max_position_embeddings,
    }
    for pname, value in positive.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{pname} must be a positive int, got {value!r}")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({num_key_value_heads})"
        )
    if num_experts_per_tok > num_local_experts:
        raise ValueError(
            f"num_experts_per_tok ({num_experts_per_tok}) must be <= num_local_experts ({num_local_experts})"
        )
    for pname, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ValueError(f"{pname} {value} is outside the vocabulary [0, {vocab_size})")
    for value in [eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []):
        if not 0 <= value < vocab_size:
            raise ValueError(f"eos_token_id {value} is outside the vocabulary [0, {vocab_size})")

    # The real config's YaRN: factor 32 over original_max_position_embeddings (4096 -> 131072); keep that shape.
    original_max_pos = max(1, max_position_embeddings // 32)
    rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": max_position_embeddings / original_max_pos,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": original_max_pos,
    }
    config = GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        sliding_window=sliding_window,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        # As in openai/gpt-oss-20b's config.json: layer 0 sliding, then alternating.
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    torch.manual_seed(seed)
    return GptOssForCausalLM(config).to(torch.bfloat16).eval()


def build_tiny(family: str, rows: list[dict], tiny, out_dir: Path) -> list[float]:
    """Tokenizer trained on the rows, a random model of `family` pretrained on them as plain text, saved to
    out_dir (gpt-oss with its experts in MXFP4, like openai/gpt-oss-20b). Returns the pretraining losses."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    train_tokenizer(bounded_corpus(tokenizer_corpus(rows)), tiny.vocab_size, family, out_dir, tools=uses_tools(rows),
                    max_token_length=TOKEN_CHARS)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = (tiny_qwen2 if family == "tiny-qwen2" else tiny_gpt_oss)(tokenizer, tiny).float()
    losses = pretrain(model, tokenizer, pretraining_corpus(rows), tiny.pretrain_steps, tiny.seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family]["eos"]]
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    if family == "tiny-gpt-oss":
        from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint

        save_mxfp4_checkpoint(model.to(torch.bfloat16), out_dir)  # gpt-oss ships in bf16 + MXFP4
    else:
        model.save_pretrained(out_dir)
    return losses


def tokenizer_corpus(rows: list[dict]) -> list[str]:
    """Every text the chat template will wrap: message contents, reasoning, and the role names."""
    texts = ["system", "developer", "user", "assistant", "analysis", "final"]
    for row in rows:
        for message in row.get("messages", []):
            texts.append(message.get("content") or "")
            texts.append(message.get("thinking") or "")
            texts += [json.dumps(call["function"], ensure_ascii=False) for call in message.get("tool_calls") or []]
        if row.get("tools"):
            texts.append(json.dumps(row["tools"], ensure_ascii=False))
        if "text" in row and "messages" not in row:
            texts.append(row["text"])
    return texts


def bounded_corpus(texts: list[str]) -> list[str]:
    """The texts each cut to TOKENIZER_TEXT_CHARS characters, and all of them together to TOKENIZER_CORPUS_CHARS."""
    bounded, left = [], TOKENIZER_CORPUS_CHARS
    for text in texts:
        if left <= 0:
            break
        bounded.append(text[:min(TOKENIZER_TEXT_CHARS, left)])
        left -= len(bounded[-1])
    return bounded


def pretraining_corpus(rows: list[dict]) -> list[str]:
    """Plain text for the tiny base's pretraining: each conversation as prose (question, reasoning, answer)
    with no chat format or roles, headed by the reasoning's language name where the row gives it (as a
    pretrained model knows what "German" means). Following "reasoning language: X" in a system prompt is
    left for fine-tuning to teach."""
    texts = []
    for row in rows:
        if "messages" not in row:  # a text row: pretrained on as it is
            texts.append(row["text"])
            continue
        body = "\n".join(text for m in row.get("messages", []) if m["role"] != "system"
                         for text in (m.get("thinking"), m["content"]) if text)
        texts.append(f"Language: {row['reasoning_language']}\n{body}" if row.get("reasoning_language") else body)
    return texts


def cut_to_tokens(texts: list[str], tokenizer, max_length: int) -> list[str]:
    """Each text cut to as many characters as its first max_length tokens can span, so that a long text costs the
    tokenizer what an ordinary one does. A token is at most the longest vocabulary entry's bytes (one character or
    more each), and NFC normalisation at most triples a text: a cut at 4x that many characters keeps more than
    max_length tokens, the same first ones as the whole text's. Shorter texts are returned as they are."""
    bound = 4 * max_length * max(len(token) for token in tokenizer.get_vocab())
    return [text[:bound] for text in texts]


def pretrain(model, tokenizer, texts: list[str], steps: int, seed: int, batch_size: int = 32,
             max_length: int = 128, learning_rate: float = 3e-3) -> list[float]:
    """Full-parameter causal-LM training on plain texts; returns the loss per step."""
    if steps <= 0:
        return []
    generator = torch.Generator().manual_seed(seed)
    # fused: its own square root. The loop form takes MKL's, which rounds differently on Intel and AMD CPUs.
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01, fused=True)
    # Warm-up over a tenth of the steps, and over more than one step (one-cycle divides by its length less one):
    # from 2 to 14 steps a tenth is too short.
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps,
                                                   pct_start=max(0.1, 1.5 / steps))
    # Each text tokenized once (cut first, so a long one costs what an ordinary one does); batches are padded copies.
    encoded = tokenizer([text + tokenizer.eos_token for text in cut_to_tokens(texts, tokenizer, max_length)],
                        truncation=True, max_length=max_length)["input_ids"]
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=generator).tolist()
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses
