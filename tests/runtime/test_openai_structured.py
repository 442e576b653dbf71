"""A request body's structured output and the sampling fields the server maps (`runtime.openai_structured`,
`runtime.openai_protocol`), as vLLM's server reads them: vLLM's older ``guided_*`` fields become
structured outputs that hold the reply (one constraint a request, ``guided_whitespace_pattern``
refused, ``guided_decoding_backend`` ignored), ``logit_bias`` is clamped to OpenAI's range, and
vLLM's fields that would change the output without a counterpart here are refused rather than
ignored."""

import re

import pytest

from vexact_models.runtime import LLM
from vexact_models.runtime.openai_protocol import ProtocolError, read_chat, read_completion
from vexact_models.runtime.structured_outputs import StructuredOutputsParams

from .llm_support import gen, save_bpe_checkpoint

MESSAGES = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _tokenize(text: str) -> list[int]:
    return [5, 6]


def _completion(**fields):
    return read_completion({"prompt": "x", **fields}, _tokenize, max_model_len=64).params[0]


def _chat(**fields):
    return read_chat({"messages": MESSAGES, **fields}, lambda messages, **kw: [5], 64).params[0]


@pytest.mark.parametrize("field, value, spec", [
    ("guided_json", SCHEMA, StructuredOutputsParams(json=SCHEMA)),
    ("guided_json", '{"type": "object"}', StructuredOutputsParams(json='{"type": "object"}')),
    ("guided_regex", "a+", StructuredOutputsParams(regex="a+")),
    ("guided_choice", ["yes", "no"], StructuredOutputsParams(choice=["yes", "no"])),
    ("guided_grammar", 'root ::= "a"', StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_vllms_guided_fields_are_read_as_structured_outputs(field, value, spec):
    assert _completion(**{field: value}).structured_outputs == spec
    assert _chat(**{field: value, "guided_decoding_backend": "xgrammar"}).structured_outputs == spec
    assert _chat(**{field: value, "response_format": {"type": "text"}}).structured_outputs == spec


@pytest.mark.parametrize("fields, param, match", [
    (dict(guided_json=SCHEMA, structured_outputs={"regex": "a"}), "guided_json", "cannot be given with 'structured_outputs'"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "cannot be given with 'response_format'"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "only one of 'guided_json', 'guided_regex'"),
    (dict(guided_json=SCHEMA, guided_whitespace_pattern=" "), "guided_whitespace_pattern", "is not supported"),
    (dict(guided_choice="yes"), "guided_choice", r"'guided_choice'='yes': .* must be a non-empty list of strings"),
    (dict(guided_json="{nope"), "guided_json", "is not valid JSON"),
    (dict(use_beam_search=True), "use_beam_search", r"'use_beam_search'=True is not supported \(only false\)"),
    (dict(logits_processors=["a.b"]), "logits_processors", "is not supported"),
    (dict(add_special_tokens=False), "add_special_tokens", r"is not supported \(only true\)"),
    (dict(return_tokens_as_token_ids=True), "return_tokens_as_token_ids", "is not supported"),
    (dict(logit_bias={"5": "high"}), "logit_bias", "values must be numbers"),
])
def test_fields_that_cannot_be_honoured_are_a_400_naming_them(fields, param, match):
    with pytest.raises(ProtocolError, match=match) as info:
        _completion(**fields)
    assert info.value.param == param


def test_a_chat_refuses_its_own_template_and_special_tokens_added():
    for fields, param in ((dict(chat_template="{{ x }}"), "chat_template"),
                          (dict(add_special_tokens=True), "add_special_tokens")):
        with pytest.raises(ProtocolError, match="is not supported") as info:
            _chat(**fields)
        assert info.value.param == param
    assert _chat(add_special_tokens=False, use_beam_search=False, user="me").max_tokens == 63  # (the defaults: taken)


def test_spaces_between_special_tokens_reaches_the_engine():
    assert _completion(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    assert _chat().spaces_between_special_tokens is True


def test_logit_bias_is_clamped_to_openais_range():
    assert _completion(logit_bias={"5": 250, "6": -1e39, "7": 3.5, "8": -100}).logit_bias == {
        5: 100.0, 6: -100.0, 7: 3.5, 8: -100.0}
    assert _chat(logit_bias={"9": 101}).logit_bias == {9: 100.0}


def test_a_guided_field_holds_the_reply(tmp_path):
    """The reply follows a ``guided_regex`` / ``guided_choice`` (it was free before vLLM's older
    fields were read)."""
    pytest.importorskip("xgrammar")
    llm = LLM(str(save_bpe_checkpoint(tmp_path)), device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    tokenize = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for i, field in enumerate(({"guided_regex": "(yes|no way)"}, {"guided_choice": ["yes", "no way"]})):
        request = read_completion({"prompt": "x", "max_tokens": 12, "seed": 4 + i, "temperature": 1.0, **field}, tokenize)
        [out] = gen(llm, [request.prompts[0]], request.params[0])
        assert re.fullmatch("(yes|no way)", out.outputs[0].text), out.outputs[0].text
