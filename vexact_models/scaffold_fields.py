"""Config fields in a ``vexact new-architecture`` copy (see `scaffold`): what the template reads or
sets that the new config class lacks, and what the new class adds that nothing reads.

A hub ``config.json`` holds only its config class's fields, so the copy must neither read a field
the new class lacks (`default_missing_fields` turns ``config.f`` into ``getattr(config, "f",
<template default>)``) nor set one in its tiny test config (`drop_tiny_config_fields`: a field
the class does not define would be kept as a stray attribute, and the tests would exercise a
config no published checkpoint has). The guide is docs/adding-an-architecture.md, section 2.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
#: Config values a rewritten ``config.<field>`` may default to (written as Python literals).
_LITERAL_TYPES = (bool, int, float, str, type(None))


def line_offsets(text: str) -> list[int]:
    """Offset of each line's start (tokenize and ast positions are (line, column))."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    return offsets


def field_differences(template_config_class: type, new_config_class: type, texts) -> tuple[dict[str, object], list[str]]:
    """(fields the template's code reads as ``config.<f>`` that the new config class lacks, with
    the template config's default; fields the new config class has, the template's lacks and no
    shared module mentions: the copy ignores them. Mistral's ``sliding_window`` is not one: the
    shared `layers.layer_window` reads it)."""
    template_config = template_config_class()
    new_config = new_config_class()
    read = {m for text in texts for m in re.findall(r"\bconfig\.([A-Za-z_]\w*)\b(?!\s*\()", text)}
    missing = {f: getattr(template_config, f) for f in sorted(read)
               if hasattr(template_config, f) and not hasattr(new_config, f)}
    shared = "\n".join(path.read_text() for path in _PACKAGE_DIR.glob("*.py") if not path.name.startswith("scaffold"))
    ignored = sorted(f for f in set(new_config.to_dict()) - set(template_config.to_dict())
                     if not re.search(rf"\b{re.escape(f)}\b", shared))
    return missing, ignored


def default_missing_fields(text: str, fields: dict[str, object]) -> str:
    """``config.attention_bias`` -> ``getattr(config, "attention_bias", False)`` for the fields
    the new config class lacks (a published config.json of that model type has no such field;
    the template config's default is the feature switched off)."""
    quotes = {}  # offset -> the quote of the string token around it (an f-string's expression must use the other)
    offsets = line_offsets(text)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            start = offsets[tok.start[0] - 1] + tok.start[1]
            quote = tok.string.lstrip("rRbBfFuU")[0]
            quotes.update((i, quote) for i in range(start, offsets[tok.end[0] - 1] + tok.end[1]))

    def replace(match: re.Match) -> str:
        quote = "'" if quotes.get(match.start()) == '"' else '"'
        return f"getattr(config, {quote}{match.group(1)}{quote}, {fields[match.group(1)]!r})"

    names = [name for name, default in fields.items() if isinstance(default, _LITERAL_TYPES)]
    if names:
        text = re.sub(rf"\bconfig\.({'|'.join(map(re.escape, names))})\b(?!\s*=[^=])", replace, text)
    return wrap_lines(text)


def drop_tiny_config_fields(text: str, new_config_class: type) -> tuple[str, dict[str, str]]:
    """Remove from the tiny configs (the ``dict(...)`` / ``<X>Config(...)`` calls inside the
    module's ``tiny*`` functions) every keyword the new config class does not define, e.g. Llama's
    ``head_dim=16, mlp_bias=False`` copied for OLMo2. Returns (the text, {field: the value's source
    text} of what was dropped), for `scaffold.next_steps` to say so."""
    new_config = new_config_class()
    tree = ast.parse(text)
    offsets = line_offsets(text)
    lines = text.splitlines(keepends=True)

    def at(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return offsets[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    spans, dropped = [], {}
    for function in tree.body:
        if not (isinstance(function, ast.FunctionDef) and function.name.startswith("tiny")):
            continue
        for call in ast.walk(function):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and (call.func.id == "dict" or call.func.id.endswith("Config"))):
                continue
            keywords = call.keywords
            for i, kw in enumerate(keywords):
                if kw.arg is None or hasattr(new_config, kw.arg):
                    continue
                dropped[kw.arg] = ast.get_source_segment(text, kw.value)
                if i + 1 < len(keywords):  # "name=value, " up to the next keyword
                    spans.append((at(kw.lineno, kw.col_offset), at(keywords[i + 1].lineno, keywords[i + 1].col_offset)))
                else:  # the last one: ", name=value" from the end of the last keyword kept
                    kept = [k for k in keywords[:i] if k.arg is None or hasattr(new_config, k.arg)]
                    start = at(kept[-1].end_lineno, kept[-1].end_col_offset) if kept else at(kw.lineno, kw.col_offset)
                    spans.append((start, at(kw.end_lineno, kw.end_col_offset)))
    for start, end in reversed(_union(spans)):
        text = text[:start] + text[end:]
    return wrap_lines(text), dropped


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def wrap_lines(text: str, width: int = 130) -> str:
    """`wrap` every line of `text`."""
    return "".join(wrap(line, width) for line in text.splitlines(keepends=True))


def wrap(line: str, width: int = 130) -> str:
    """Break a line the rewrite made too long after its last comma that fits, inside brackets,
    indenting the rest under the innermost open bracket (as the house style does)."""
    if len(line.rstrip("\n")) <= width:
        return line
    opens: list[int] = []
    best = None
    quote = None
    for i, ch in enumerate(line[:width]):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            opens.append(i)
        elif ch in ")]}" and opens:
            opens.pop()
        elif ch == "," and opens and line[i + 1:i + 2] == " ":
            best = (i, opens[-1])
    if best is None:
        return line
    cut, column = best
    return line[:cut + 1] + "\n" + wrap(" " * (column + 1) + line[cut + 2:], width)
