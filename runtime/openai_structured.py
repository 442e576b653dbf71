"""The structured output an OpenAI request body asks for (`runtime.openai_protocol` reads it into
``SamplingParams.structured_outputs``): vLLM's ``structured_outputs`` dict, OpenAI's
``response_format`` (``json_object``, ``json_schema``), or vLLM's older fields, which vLLM up to
0.10 read: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

One request names one constraint: a ``guided_*`` field beside ``structured_outputs`` or a
``response_format`` other than text, or two ``guided_*`` fields, is a `ProtocolError` (HTTP 400)
naming the field, as is ``guided_whitespace_pattern`` (another backend's option: xgrammar's JSON
whitespace is ``disable_any_whitespace``); ``guided_decoding_backend`` is ignored (one backend
here, xgrammar, vLLM's default).
"""

from __future__ import annotations

from .openai_errors import ProtocolError
from .structured_outputs import StructuredOutputsParams

__all__ = ["GUIDED", "structured_outputs"]

#: vLLM's older request fields, each the `StructuredOutputsParams` field it sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The body's constraint: ``structured_outputs`` (vLLM's dict), OpenAI's ``response_format``,
    or a ``guided_*`` field (None: none)."""
    guided = _guided(body)
    fmt, given = body.get("response_format"), body.get("structured_outputs")
    if guided is not None:
        other = "structured_outputs" if given is not None else "response_format" if _formats(fmt) else None
        if other is not None:
            raise ProtocolError(f"'{guided[0]}' cannot be given with '{other}': give one constraint (vLLM's "
                                f"'structured_outputs' replaces the guided_* fields)", guided[0])
        try:
            return StructuredOutputsParams(**{GUIDED[guided[0]]: guided[1]})
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"'{guided[0]}'={guided[1]!r}: {err}", guided[0]) from None
    if given is not None:
        try:
            return StructuredOutputsParams.of(given)
        except (TypeError, ValueError) as err:
            raise ProtocolError(str(err), "structured_outputs") from None
    if not _formats(fmt):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise ProtocolError(f"'response_format' must have type 'text', 'json_object' or 'json_schema', got {fmt!r}",
                            "response_format")
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ProtocolError("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return StructuredOutputsParams(json=schema)


def _formats(fmt) -> bool:
    """Whether a ``response_format`` asks for a constraint (not absent, null or text)."""
    return fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")


def _guided(body: dict) -> tuple[str, object] | None:
    """(name, value) of the body's one ``guided_*`` constraint (None: none); a `ProtocolError`
    for two, or for ``guided_whitespace_pattern``."""
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        raise ProtocolError(f"'guided_whitespace_pattern'={pattern!r} is not supported (xgrammar's JSON whitespace is "
                            "'structured_outputs': {'disable_any_whitespace': true}); leave it out",
                            "guided_whitespace_pattern")
    named = [(name, body[name]) for name in GUIDED if body.get(name) is not None]
    if len(named) > 1:
        raise ProtocolError(f"only one of {', '.join(repr(n) for n in GUIDED)} may be given, got "
                            f"{', '.join(repr(n) for n, _ in named)}", named[1][0])
    return named[0] if named else None
