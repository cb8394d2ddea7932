"""Conversations: the tiny models' chat templates, the rows train hands to TRL, prompts, and reasoning extraction."""
from __future__ import annotations

import json
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

# A tool call's arguments as text: the rows hold them as JSON text (OpenAI's form); a mapping is written as JSON.
_ARGUMENTS = "(call.function.arguments if call.function.arguments is string else call.function.arguments | tojson)"

# The same with tools, as Qwen2.5's template renders them: the function schemas in the system turn, each call in
# <tool_call> tags inside the assistant turn, tool turns as <tool_response> in a user turn. The tiny models get it
# when their data holds tools (the built-in data holds none).
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nEach call: a JSON object with name and arguments within <tool_call></tool_call>.'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.thinking %}{{- '<think>\\n' + message.thinking + '\\n</think>\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + " + _ARGUMENTS
    + " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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
# The same with tools, as gpt-oss's own template renders them: the functions in the developer message, each call on
# the commentary channel to=functions.<name>, ending in <|call|>, the tool's answer from functions.<name>.
HARMONY_TOOLS_TEMPLATE = (
    "{%- set ns = namespace(call='tool') %}"
    "{%- if tools %}"
    "{{- '<|start|>developer<|message|>' }}"
    "{%- if messages[0].role in ['system', 'developer'] %}"
    "{{- '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}"
    "{%- set function = tool.function or tool %}"
    "{{- '\\n// ' + (function.description or '') + '\\ntype ' + function.name + ' = (_: '"
    " + (function.parameters | tojson) + ') => any;\\n' }}"
    "{%- endfor %}"
    "{{- '\\n} // namespace functions<|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role in ['system', 'developer'] %}"
    "{%- elif message.role in ['system', 'developer'] %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + (message.name or ns.call) + ' to=assistant<|channel|>commentary<|message|>'"
    " + message.content + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>assistant' }}"
    "{%- generation %}"
    "{%- if message.thinking %}"
    "{{- '<|channel|>analysis<|message|>' + message.thinking + '<|end|><|start|>assistant' }}"
    "{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set ns.call = call.function.name %}"
    "{%- if not loop.first %}{{- '<|start|>assistant' }}{%- endif %}"
    "{{- '<|channel|>commentary to=functions.' + call.function.name + ' <|constrain|>json<|message|>' + "
    + _ARGUMENTS + " + '<|call|>' }}"
    "{%- endfor %}"
    "{%- else %}"
    "{{- '<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- endif %}"
    "{%- endgeneration %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>",
                          "<|channel|>", "<|return|>", "<|call|>"]


TOOL_KEYS = ("tool_calls", "name", "tool_call_id")  # what tool-calling messages add to role, content and thinking


def conversation(row: dict, tool_keys: bool | None = None, weight: bool = False) -> list[dict]:
    """The row's messages with a `thinking` key on every message (so one Arrow schema fits all rows); with
    tool_keys (None: where the row uses tools), TOOL_KEYS on every message too; with weight, a `weight` key on every
    message (None where the message has none: a turn trained as usual)."""
    keys = TOOL_KEYS if (uses_tools([row]) if tool_keys is None else tool_keys) else ()
    keys += ("weight",) if weight else ()
    return [{"role": m["role"], "content": m["content"], "thinking": m.get("thinking"), **{k: m.get(k) for k in keys}}
            for m in row["messages"]]


def as_text(tokenizer, row: dict) -> str:
    """A row as the model reads it: a conversation through the chat template (with its tools), a text row as is."""
    if "messages" not in row:
        return row["text"]
    return tokenizer.apply_chat_template(conversation(row), tools=row.get("tools") or None, tokenize=False)


def uses_tools(rows: list[dict]) -> bool:
    """Whether any row offers tools, calls one or answers as one."""
    return any(row.get("tools") or any(m.get("tool_calls") or m["role"] == "tool" for m in row.get("messages", []))
               for row in rows)


def has_weights(rows: list[dict]) -> bool:
    """Whether any message of the rows carries a `weight` (OpenAI's per-turn 0 or 1: weight 0 is context, not a
    target)."""
    return any("weight" in m for row in rows for m in row.get("messages", []))


def training_rows(rows: list[dict]) -> list[dict]:
    """The rows as TRL's SFTTrainer takes them: {messages}; with tools, {messages, tools} (the tools as JSON text,
    which TRL passes to the chat template as tools=...); text rows as {text} (plain language modeling). Messages
    keep their `weight` only where the data gives one."""
    if rows and "messages" not in rows[0]:
        return [{"text": row["text"]} for row in rows]
    weight = has_weights(rows)
    if not uses_tools(rows):
        return [{"messages": conversation(row, tool_keys=False, weight=weight)} for row in rows]
    return [{"messages": conversation(row, tool_keys=True, weight=weight),
             "tools": json.dumps(row.get("tools") or None)} for row in rows]


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
