"""Streamed chat deltas joined as OpenAI's clients join them (tests of `runtime.openai_tools`,
`runtime.tool_call_stream`, `runtime.harmony`)."""

from __future__ import annotations

import random


def join_deltas(deltas: list[dict]) -> dict:
    """One message from a choice's delta messages: content and reasoning joined, each tool call's
    pieces joined by index. Checks the stream's form: a call's first item carries its id, type
    and name, its later items only more arguments, and the indices count up from 0."""
    message = {"content": "", "reasoning": "", "tool_calls": []}
    for delta in deltas:
        message["content"] += delta.get("content") or ""
        message["reasoning"] += delta.get("reasoning") or ""
        for item in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if item["index"] == len(calls):
                assert item["id"].startswith("chatcmpl-tool-") and item["type"] == "function", item
                calls.append({"id": item["id"], "type": "function", "function": dict(item["function"])})
            else:
                assert item["index"] == len(calls) - 1 and set(item) == {"index", "function"}, item
                assert set(item["function"]) == {"arguments"}, item
                calls[-1]["function"]["arguments"] += item["function"]["arguments"]
    return message


def pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random places (seed -1: a character at a time)."""
    if seed < 0:
        return list(text)
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        out.append(text[at:at + step])
        at += step
    return out


def stream_of(stream, text: str, seed: int = -1) -> list[dict]:
    """`stream`'s delta messages for `text` fed in `pieces`."""
    parts = pieces(text, seed)
    return [stream.delta(part, i == len(parts) - 1) for i, part in enumerate(parts)]
