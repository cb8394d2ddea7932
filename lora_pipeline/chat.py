"""Conversations: row schema checks, the tiny models' chat templates, prompts, and reasoning extraction."""
from __future__ import annotations

import re
from typing import NamedTuple

ROLES = ("system", "developer", "user", "assistant")

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


class Problem(NamedTuple):
    """Why a row cannot be used: a reason key (counted when rows are dropped) and the field with what is wrong."""
    reason: str
    detail: str


def row_problem(row) -> Problem | None:
    """The first reason the row is not a usable conversation, or None if it is one."""
    if not isinstance(row, dict):
        return Problem("not_a_conversation", f"row: must be an object with 'messages', got {type(row).__name__}")
    messages = row.get("messages")
    if messages is None:
        return Problem("not_a_conversation", "messages: missing")
    if not isinstance(messages, list) or not messages:
        return Problem("not_a_conversation",
                       f"messages: must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for i, message in enumerate(messages):
        problem = _message_problem(message, f"messages[{i}]")
        if problem:
            return problem
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return Problem("no_assistant_turn", f"messages: no assistant turn to learn from (roles {roles})")
    return _order_problem(roles) or _empty_problem(messages)


def _message_problem(message, field: str) -> Problem | None:
    if not isinstance(message, dict):
        return Problem("bad_message", f"{field}: must be an object with role and content, got {type(message).__name__}")
    if message.get("role") not in ROLES:
        return Problem("unknown_role", f"{field}.role: {message.get('role')!r} is not one of {ROLES}")
    for key, allowed in (("content", (str,)), ("thinking", (str, type(None)))):
        value = message.get(key)
        if not isinstance(value, allowed):
            expected = "a string" if key == "content" else "a string or null"
            return Problem("non_string_content", f"{field}.{key}: must be {expected}, got {type(value).__name__}")
    return None


def _order_problem(roles: list[str]) -> Problem | None:
    """System/developer messages first, then user and assistant turns alternating from user to assistant."""
    expected = "user"
    started = False
    for i, role in enumerate(roles):
        if role in ("system", "developer"):
            if started:
                return Problem("roles_out_of_order", f"messages[{i}].role: '{role}' after the first user turn; "
                                                     "system and developer messages come first")
            continue
        started = True
        if role != expected:
            after = f"follows '{roles[i - 1]}'" if i and roles[i - 1] == role else "comes before any user turn"
            return Problem("roles_out_of_order",
                           f"messages[{i}].role: '{role}' {after}; user and assistant turns must alternate")
        expected = "assistant" if role == "user" else "user"
    if roles[-1] != "assistant":
        return Problem("roles_out_of_order",
                       f"messages[{len(roles) - 1}].role: the conversation ends with '{roles[-1]}', "
                       "not with an assistant turn")
    return None


def _empty_problem(messages: list[dict]) -> Problem | None:
    """User and assistant turns need text; an empty system prompt is harmless."""
    for i, message in enumerate(messages):
        if message["role"] in ("user", "assistant") and not message["content"].strip():
            return Problem("empty_content", f"messages[{i}].content: empty")
    return None


def conversation_chars(row: dict) -> int:
    """Characters of text in a usable row: every message's content and reasoning."""
    return sum(len(m["content"]) + len(m.get("thinking") or "") for m in row["messages"])


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
