"""Conversations: the tiny models' chat templates, prompts, and reasoning extraction."""
from __future__ import annotations

import re

# ChatML with the reasoning in <think> tags (as Qwen's reasoning models do). {% generation %} marks the
# tokens TRL trains on when train.sft.assistant_only_loss is true.
CHATML_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.thinking %}{{- '<think>\\n' + message.thinking + '\\n</think>\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# The harmony format of gpt-oss, reduced to what these conversations use: the system prompt goes into the
# developer message (as gpt-oss's own template does), the reasoning into the analysis channel, the answer
# into the final channel. Real gpt-oss checkpoints bring their own, complete template.
HARMONY_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role in ['system', 'developer'] %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>assistant' }}"
    "{%- generation %}"
    "{%- if message.thinking %}"
    "{{- '<|channel|>analysis<|message|>' + message.thinking + '<|end|><|start|>assistant' }}"
    "{%- endif %}"
    "{{- '<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- endgeneration %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>",
                          "<|channel|>", "<|return|>", "<|call|>"]


def conversation(row: dict) -> list[dict]:
    """The row's messages with a `thinking` key on every message (so one Arrow schema fits all rows)."""
    return [{"role": m["role"], "content": m["content"], "thinking": m.get("thinking")} for m in row["messages"]]


def prompt_messages(question: str, reasoning_language: str | None, developer: str = "") -> list[dict]:
    """A system prompt in the Multilingual-Thinking form, then the user's question."""
    system = f"reasoning language: {reasoning_language}" if reasoning_language else ""
    if developer:
        system = f"{system}\n\n{developer}" if system else developer
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": question}]


_HARMONY_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", re.S)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.S)
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def split_reasoning(generated: str) -> tuple[str, str]:
    """(reasoning, final answer) of a generated assistant turn, decoded with its special tokens kept."""
    if "<|channel|>" in generated:
        analysis = _HARMONY_ANALYSIS.search(generated)
        final = _HARMONY_FINAL.search(generated)
        return (analysis.group(1).strip() if analysis else "", final.group(1).strip() if final else "")
    think = _THINK.search(generated)
    if think:
        final = generated[think.end():]
        return think.group(1).strip(), _SPECIAL.split(final)[0].strip() if "</think>" in generated else ""
    return "", _SPECIAL.split(generated)[0].strip()
