"""Row checks: whether a data row is a usable conversation (or text, TRL's language-modeling rows), and if not, which
field says why; DataError names it."""
from __future__ import annotations

import json
from typing import NamedTuple

ROLES = ("system", "developer", "user", "assistant", "tool")


class DataError(ValueError):
    """The data cannot be used; the message names the file, the row or line, and the field."""


class Problem(NamedTuple):
    """Why a row cannot be used: a reason key (counted when rows are dropped) and the field with what is wrong."""
    reason: str
    detail: str


def row_problem(row) -> Problem | None:
    """The first reason the row is not a usable conversation, or None if it is one."""
    if not isinstance(row, dict):
        return Problem("not_a_conversation", f"row: must be an object with 'messages', got {type(row).__name__}")
    if "messages" not in row and isinstance(row.get("text"), str):  # text rows: checked when read
        return None
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
    return (_order_problem(roles, [bool(m.get("tool_calls")) for m in messages]) or _empty_problem(messages)
            or _weight_problem(messages))


def _message_problem(message, field: str) -> Problem | None:
    if not isinstance(message, dict):
        return Problem("bad_message", f"{field}: must be an object with role and content, got {type(message).__name__}")
    if message.get("role") not in ROLES:
        return Problem("unknown_role", f"{field}.role: {message.get('role')!r} is not one of {ROLES}")
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list) or not calls):
        return Problem("bad_tool_call", f"{field}.tool_calls: a non-empty list, in an assistant turn only")
    for key, allowed in (("content", (str, type(None)) if calls else (str,)), ("thinking", (str, type(None)))):
        value = message.get(key)
        if not isinstance(value, allowed):
            expected = "a string" if key == "content" else "a string or null"
            if key not in message:
                return Problem("non_string_content", f"{field}.{key}: missing (must be {expected})")
            return Problem("non_string_content", f"{field}.{key}: must be {expected}, got {type(value).__name__}")
    weight = message.get("weight")
    if weight is not None and (message["role"] != "assistant" or weight not in (0, 1) or isinstance(weight, bool)):
        where = "" if message["role"] == "assistant" else f" on a '{message['role']}' turn"
        return Problem("bad_weight", f"{field}.weight: {weight!r:.40}{where}; a weight is 0 (not trained) or 1, on "
                                     "an assistant turn only")
    return None


def _order_problem(roles: list[str], calls: list[bool]) -> Problem | None:
    """System/developer messages first, then user and assistant turns alternating from user to assistant; an
    assistant turn that calls tools (calls[i]) is followed by one or more tool turns, and those by an assistant turn."""
    expected = "user"
    started = False
    for i, role in enumerate(roles):
        if role in ("system", "developer"):
            if started:
                return Problem("roles_out_of_order", f"messages[{i}].role: '{role}' after the first user turn; "
                                                     "system and developer messages come first")
            continue
        first, started = not started, True
        if role != expected and not (expected == "tool or assistant" and role in ("tool", "assistant")):
            if expected.startswith("tool"):
                return Problem("roles_out_of_order", f"messages[{i}].role: '{role}' follows '{roles[i - 1]}'; an "
                                                     "assistant turn that calls tools is followed by their tool "
                                                     "turns, then an assistant turn")
            after = "comes before any user turn" if first else f"follows '{roles[i - 1]}'"
            return Problem("roles_out_of_order",
                           f"messages[{i}].role: '{role}' {after}; user and assistant turns must alternate")
        if role == "user":
            expected = "assistant"
        elif role == "tool":
            expected = "tool or assistant"
        else:
            expected = "tool" if calls[i] else "user"
    if roles[-1] != "assistant":
        return Problem("roles_out_of_order",
                       f"messages[{len(roles) - 1}].role: the conversation ends with '{roles[-1]}', "
                       "not with an assistant turn")
    return None


def _empty_problem(messages: list[dict]) -> Problem | None:
    """User and assistant turns need text; an empty system prompt is harmless."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message["role"] in ("user", "assistant") and not calls and not message["content"].strip():
            return Problem("empty_content", f"messages[{i}].content: empty")
    return None


def _weight_problem(messages: list[dict]) -> Problem | None:
    """A row whose every assistant turn has weight 0 (OpenAI's "do not train on this turn") has nothing to train."""
    if all(m.get("weight") == 0 for m in messages if m["role"] == "assistant"):
        return Problem("no_trained_turn", "messages: every assistant turn has weight 0, so no turn is left to train")
    return None


def conversation_chars(row: dict) -> int:
    """Characters of text in a usable row: every message's content, reasoning and tool calls (a text row's text)."""
    if "messages" not in row:
        return len(row["text"])
    return sum(len(m.get("content") or "") + len(m.get("thinking") or "")
               + sum(len(json.dumps(call)) for call in m.get("tool_calls") or []) for m in row["messages"])


def row_key(row: dict) -> str:
    """What makes two usable rows the same: their messages (messages_key), their tools too, or their text."""
    if "messages" not in row:
        return json.dumps(row["text"], ensure_ascii=False)
    key = messages_key(row["messages"])
    return key + json.dumps(row["tools"], sort_keys=True) if row.get("tools") else key


def messages_key(messages: list[dict]) -> str:
    """Messages as canonical JSON (a missing `thinking` and a null one are the same)."""
    return json.dumps([{**m, "thinking": m.get("thinking")} for m in messages], sort_keys=True, ensure_ascii=False)
