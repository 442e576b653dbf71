"""vLLM's structured outputs: ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``
keeps a request's generated text inside a JSON schema, a regular expression, a list of choices or
an EBNF grammar. The grammars are compiled by xgrammar (vLLM's default backend; the
``structured`` extra) over the engine's tokenizer, and followed token by token
(`runtime.grammar_masks`).

Exactness: at each step a constrained row may sample only the tokens its grammar allows after its
own generated tokens; the other logits become -inf before the logit edits, penalties and filters
(vLLM's order). The mask is a function of the sequence's own tokens, so a request samples the same
tokens in any batch and under preemption (rule 7), and the reported logprob stays the unmasked one
that training recomputes (vLLM's default ``logprobs_mode``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Grammars", "StructuredOutputsConfig", "StructuredOutputsParams", "choice_grammar", "xgrammar_module"]

#: the constraint fields, exactly one of which a `StructuredOutputsParams` sets
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: vLLM's fields this engine accepts only at their defaults (another backend's options)
_UNSUPPORTED = {"whitespace_pattern": None, "disable_additional_properties": False}
#: vLLM's fields with nothing to do here: one backend, hence no fallback to disable
_IGNORED = ("disable_fallback", "_backend", "_backend_was_auto")
#: the schema of ``json_object``: any JSON object
JSON_OBJECT = '{"type": "object"}'


@dataclass
class StructuredOutputsParams:
    """One request's output constraint, as vLLM's ``StructuredOutputsParams``.

    Attributes (exactly one of the first six is set):
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value it accepts.
        regex: the output matches this regular expression (xgrammar's syntax: Python's, without
            look-around or back-references).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, start rule ``root``).
        json_object: True: the output is any JSON object (vLLM's: xgrammar's grammar of the schema
            ``{"type": "object"}``, so not an array or a scalar).
        structural_tag: an xgrammar structural tag (a dict, or its JSON text, as vLLM takes it):
            ``{"type": "structural_tag", "format": {...}}`` (xgrammar's formats: tags with JSON
            schema, regex or grammar content, sequences, tags triggered inside free text, ...),
            or vLLM's older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers":
            [...]}``: free text in which each trigger starts one of the structures, whose
            content follows its JSON schema (tool calls).
        disable_any_whitespace: with ``json`` or ``json_object``, allow no whitespace between
            JSON tokens beyond single separators (vLLM's option).
        after_reasoning: ``(start, end)``, the texts around a reasoning block (``("<think>",
            "</think>")``): the output is free until the model writes `end`'s tokens, and held to
            the constraint after them (a prompt whose last `start` is already followed by `end`,
            a template that closed the block, holds it from the first token); None: from the
            first token. vLLM starts the grammar where its server's reasoning parser sees the
            reasoning end; `vexact serve` sets this from its ``--reasoning-parser``.

    ``__post_init__`` raises ValueError naming the field and the value.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    after_reasoning: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        set_kinds = self._set_kinds()
        if len(set_kinds) != 1:
            raise ValueError(f"StructuredOutputsParams: exactly one of {', '.join(KINDS)} must be set, got "
                             f"{set_kinds or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as err:
                raise ValueError(f"StructuredOutputsParams.json={self.json!r} is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams.json={self.json!r} must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"StructuredOutputsParams.json must be a dict or its JSON text, got "
                             f"{type(self.json).__name__}")
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"StructuredOutputsParams.choice={self.choice!r} must be a non-empty list of strings")
            for i, text in enumerate(self.choice):
                if not isinstance(text, str) or not text:
                    raise ValueError(f"StructuredOutputsParams.choice[{i}]={text!r} must be a non-empty string")
            self.choice = list(self.choice)
        pair = self.after_reasoning
        if pair is not None:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair)):
                raise ValueError(f"StructuredOutputsParams.after_reasoning={pair!r} must be two non-empty strings, the "
                                 "reasoning block's start and end (e.g. ('<think>', '</think>'))")
            self.after_reasoning = tuple(pair)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"StructuredOutputsParams.{name}={value!r} must be a bool")

    def _set_kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """Which constraint is set (one of `KINDS`)."""
        return self._set_kinds()[0]

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """`value` as a `StructuredOutputsParams`: one already, a dict of its fields (TRL's
        ``generation_kwargs``, a vLLM server payload) or vLLM's own ``StructuredOutputsParams``.
        A field of vLLM's that this engine cannot honour (``whitespace_pattern``,
        ``disable_additional_properties``) raises ValueError when set."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            fields = dict(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        else:
            raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, vLLM's, or a dict "
                             f"of its fields, got {type(value).__name__}")
        for name, default in _UNSUPPORTED.items():
            if fields.get(name, default) != default:
                raise ValueError(f"SamplingParams.structured_outputs.{name}={fields[name]!r} is not supported "
                                 f"(xgrammar's options only); leave it at {default!r}")
            fields.pop(name, None)
        for name in _IGNORED:
            fields.pop(name, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**fields)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """A server's defaults for its requests' structured outputs, as ``vllm serve
    --structured-outputs-config`` sets them (``vexact serve`` takes the same JSON).

    Attributes:
        disable_any_whitespace: JSON schemas (a request's, the tools' of ``tool_choice``
            "required" or a named function) and ``json_object`` allow no whitespace beyond
            single separators, unless the request's ``structured_outputs`` says otherwise.
        enable_in_reasoning: the grammar holds the reasoning too (vLLM's option); by default a
            server with a reasoning parser starts it after the reasoning
            (``StructuredOutputsParams.after_reasoning``).
    """

    disable_any_whitespace: bool = False
    enable_in_reasoning: bool = False

    #: vLLM's other fields, accepted at these values only (one backend here)
    _FIXED = {"backend": ("auto", "xgrammar"), "disable_additional_properties": (False,), "disable_fallback": (False, True)}

    @classmethod
    def of(cls, value: Mapping | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """`value` (a dict of vLLM's fields, or None: the defaults) checked; ValueError naming a
        field that is unknown, of the wrong type, or at a value this engine cannot honour."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs_config must be a dict of vLLM's fields, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for name, given in value.items():
            if name in cls._FIXED:
                if given not in cls._FIXED[name]:
                    raise ValueError(f"structured_outputs_config.{name}={given!r} is not supported here (one of "
                                     f"{list(cls._FIXED[name])})")
            elif name == "reasoning_parser":
                raise ValueError("structured_outputs_config.reasoning_parser: give the server's reasoning parser as "
                                 "--reasoning-parser (reasoning_parser=)")
            elif name not in known:
                raise ValueError(f"structured_outputs_config: unknown field {name!r} (known: "
                                 f"{sorted(known | set(cls._FIXED))})")
            elif not isinstance(given, bool):
                raise ValueError(f"structured_outputs_config.{name}={given!r} must be a bool")
        return cls(**{name: value[name] for name in known if name in value})

    def apply(self, spec: StructuredOutputsParams, after_reasoning: tuple[str, str] | None,
              given: Mapping | None = None) -> StructuredOutputsParams:
        """`spec` under these defaults: without whitespace in a JSON schema's or object's output, and starting
        after the reasoning block `after_reasoning` (the server's parser's; None: none), each
        unless `given` (the request's own ``structured_outputs`` dict) names the field."""
        given = given if isinstance(given, Mapping) else {}
        changes = {}
        if (self.disable_any_whitespace and (spec.json is not None or spec.json_object)
                and "disable_any_whitespace" not in given):
            changes["disable_any_whitespace"] = True
        if after_reasoning is not None and not self.enable_in_reasoning and "after_reasoning" not in given:
            changes["after_reasoning"] = after_reasoning
        return dataclasses.replace(spec, **changes) if changes else spec


class Grammars:
    """The engine's grammar compiler: xgrammar's, over one tokenizer and the model's vocabulary
    (rows past the tokenizer's tokens are never allowed). Compiled grammars are cached by
    xgrammar, keyed by their text."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`stop_token_ids`: the tokens that end a complete output (the model's EOS ids), the
        only ones a grammar allows once its text is complete."""
        xgr = xgrammar_module()
        self.tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutputsParams):
        """xgrammar's ``CompiledGrammar`` of `spec`; ValueError naming the field when it does not
        compile (a bad regex, schema or EBNF)."""
        kind = spec.kind
        value = getattr(spec, kind)
        try:
            if kind == "json":
                schema = value if isinstance(value, str) else json.dumps(value)
                return self.compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":  # (vLLM's: an object, not xgrammar's built-in grammar of any JSON value)
                return self.compiler.compile_json_schema(JSON_OBJECT, any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(value))
            if kind == "structural_tag":
                return self._compile_structural_tag(value)
            return self.compiler.compile_grammar(value)
        except Exception as err:  # xgrammar raises RuntimeError or its own errors, with the parser's message
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"LLM.generate: SamplingParams.structured_outputs.{kind}={value!r} does not compile: "
                             f"{reason}") from err

    def _compile_structural_tag(self, value: str | dict):
        """xgrammar's grammar of a structural tag: its current form as it is, vLLM's older
        ``structures`` / ``triggers`` form through xgrammar's item list."""
        tag = json.loads(value) if isinstance(value, str) else value
        if "structures" not in tag:
            return self.compiler.compile_structural_tag(json.dumps(tag))
        xgr = xgrammar_module()
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"] if isinstance(s["schema"], str)
                                       else json.dumps(s["schema"]), end=s["end"]) for s in tag["structures"]]
        return self.compiler.compile_structural_tag(items, list(tag["triggers"]))

    def matcher(self, compiled):
        """A fresh xgrammar ``GrammarMatcher`` of a compiled grammar: one sample's place in it."""
        return xgrammar_module().GrammarMatcher(compiled)


def _check_structural_tag(value: object) -> None:
    """ValueError naming what is wrong with a structural tag's shape (xgrammar checks the rest
    when it compiles): a JSON object, its text, or vLLM's ``structures`` / ``triggers`` form."""
    name = "StructuredOutputsParams.structural_tag"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}={value!r} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict or its text), got {type(value).__name__}")
    if "structures" not in value:
        if "format" not in value:
            raise ValueError(f"{name} needs a 'format' (xgrammar's structural tag) or 'structures' and 'triggers' "
                             f"(vLLM's older form); got keys {sorted(value)}")
        return
    structures, triggers = value["structures"], value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}: 'structures' must be a non-empty list, got {structures!r}")
    for i, item in enumerate(structures):
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                and isinstance(item.get("schema"), (dict, str))):
            raise ValueError(f"{name}: structures[{i}]={item!r} must hold 'begin' and 'end' strings and a 'schema'")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name}: 'triggers' must be a non-empty list of non-empty strings, got {triggers!r}")


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose only sentences are `choices`: each a string literal, its characters as
    they are but for JSON's escapes of quotes, backslashes and control characters (which xgrammar's
    literals read; ASCII escapes would write a character outside the BMP as two surrogates, which
    xgrammar reads as two characters that no text holds)."""
    return "root ::= " + " | ".join(json.dumps(text, ensure_ascii=False) for text in choices)


def xgrammar_module():
    """The xgrammar module, or ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError("SamplingParams.structured_outputs needs xgrammar: pip install 'vexact-models[structured]' "
                          "(or pip install xgrammar)") from err
    return xgrammar
