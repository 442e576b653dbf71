"""vLLM's structured outputs (``SamplingParams.structured_outputs``, `runtime.structured_outputs`,
`runtime.grammar_masks`) with the real xgrammar: every output follows its JSON schema, regex,
choice or EBNF grammar; every sampled token is the one the definition picks (the training forward's
logits, masked by a fresh xgrammar matcher fed the tokens before it, then the sampler's Gumbel-max
at its seed and index); a request's tokens do not depend on its batch, the cache, preemption or the
graphs; the reported logprobs stay the unmasked ones training recomputes; bad constraints are
refused before anything runs."""

import json
import re
from dataclasses import dataclass

import pytest
import torch

from vexact_models.runtime import LLM, SamplingParams, StructuredOutputsParams
from vexact_models.runtime.grammar_masks import GrammarMasks, GrammarRows, GrammarState, allowed_tokens
from vexact_models.runtime.sequence import Sequence, SequenceStatus
from vexact_models.runtime.structured_outputs import choice_grammar

from .llm_support import (count_waiting_samples, gen, sampled_by_definition, save_bpe_checkpoint, tokens_four_ways,
                          training_logits, training_logprobs)

xgr = pytest.importorskip("xgrammar")  # (the test extra has it; the compat venvs do not)

EOS = 0  # the tokenizer's first special token, the model's EOS
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no way", 'say "hi"\\']
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"]}
EBNF = 'root ::= "(" [a-c] [a-c]? ")"'
SPECS = [dict(regex=REGEX), dict(choice=CHOICES), dict(json=SCHEMA, disable_any_whitespace=True), dict(grammar=EBNF)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 checkpoint with a byte-level BPE tokenizer of 300 tokens (EOS = token 0)."""
    return save_bpe_checkpoint(tmp_path_factory.mktemp("structured"), eos=EOS)


def _engine(folder, **kwargs) -> LLM:
    kwargs = dict(dict(device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_batched_tokens=64), **kwargs)
    return LLM(str(folder), **kwargs)


def _params(i: int, **extra) -> SamplingParams:
    extra.setdefault("max_tokens", 40)
    return SamplingParams(temperature=[1.0, 0.0, 0.8, 1.3][i % 4], seed=70 + i,
                          structured_outputs=StructuredOutputsParams(**SPECS[i % len(SPECS)]), **extra)


def _follows(spec: dict, text: str) -> bool:
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    if "json" in spec:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return (isinstance(value, dict) and set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
                and isinstance(value["n"], int) and 0 <= value["n"] <= 99)
    return re.fullmatch(r"\([a-c]{1,2}\)", text) is not None


def _definition_tokens(llm: LLM, prompt: list[int], tokens: list[int], p: SamplingParams) -> list[int]:
    """At each output position: the training forward's logits, masked by a fresh matcher of the
    request's grammar fed the tokens before it (xgrammar's own mask), then sampled as the
    definition says (`sampled_by_definition`)."""
    x = training_logits(llm.model.causal_lm, prompt, tokens)
    grammars = llm._grammars
    matcher = grammars.matcher(grammars.compile(p.structured_outputs))
    bits = xgr.allocate_token_bitmask(1, x.shape[1])
    for i, token in enumerate(tokens):
        matcher.fill_next_token_bitmask(bits, 0)
        row = x[i:i + 1].clone()
        xgr.apply_token_bitmask_inplace(row, bits)
        x[i] = row[0]
        assert matcher.accept_token(token)
    return sampled_by_definition(x, prompt, tokens, p)


def test_outputs_follow_their_grammar_and_tokens_are_the_definitions(folder, monkeypatch):
    """Steps go ahead of the host (async scheduling): their forwards first, their sampling, the
    masks' fill included, after the step before is postprocessed (`LaunchedStep.waiting`)."""
    llm, waited = _engine(folder), count_waiting_samples(monkeypatch)
    prompts = ["123-", "(a", '{"ok', "say", "no", "9", "a", "b"]
    params = [_params(i) for i in range(8)]
    outs = gen(llm, prompts, params)
    assert len(waited) >= 5
    for i, (out, p) in enumerate(zip(outs, params)):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS, (i, c.text, c.finish_reason)
        assert _follows(SPECS[i % len(SPECS)], c.text), (i, c.text)
        prompt = out.prompt_token_ids
        assert c.token_ids == _definition_tokens(llm, prompt, c.token_ids, p)
        t = p.temperature if p.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs), training_logprobs(llm.model.causal_lm, prompt, c.token_ids, t))
    unconstrained = gen(llm, prompts[:4], [SamplingParams(temperature=1.0, max_tokens=40, seed=70 + i)
                                           for i in range(4)])
    assert sum(not _follows(SPECS[i], o.outputs[0].text) for i, o in enumerate(unconstrained)) >= 3  # masks matter


def test_constrained_rows_do_not_depend_on_their_batch_the_cache_or_the_steps(folder):
    prompts = ["123-", "(a", '{"ok', "say", "no", "9", "x"]
    params = [_params(i, repetition_penalty=1.2 if i == 5 else 1.0, max_tokens=24) for i in range(6)]
    params.append(SamplingParams(temperature=1.0, max_tokens=12, seed=3))  # an unconstrained row beside them
    batch, alone, tight, replayed = tokens_four_ways(lambda **kw: _engine(folder, **kw), prompts, params, 10)
    assert batch == alone == tight == replayed
    assert all(ids[-1] == EOS for ids in batch[:6])  # every grammar completed


def test_each_of_n_samples_follows_its_own_matcher(folder):
    llm = _engine(folder)
    [out] = gen(llm, ["1"], SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=9,
                                           structured_outputs={"regex": REGEX}))
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(REGEX, t) for t in texts) and len(set(texts)) > 1


def test_a_grammar_ends_the_sequence_even_under_ignore_eos(folder):
    llm = _engine(folder)
    [out] = gen(llm, ["x"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                           structured_outputs={"choice": ["yes", "no way"]}))
    c = out.outputs[0]
    assert c.text in ("yes", "no way") and c.token_ids[-1] == EOS and c.finish_reason == "stop"


def test_settings_that_exclude_every_token_end_the_sequence_with_an_error(folder):
    llm = _engine(folder)
    digits = [llm.tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    params = [SamplingParams(max_tokens=10, seed=1, allowed_token_ids=digits, structured_outputs={"choice": ["yes"]}),
              SamplingParams(max_tokens=10, seed=1, min_tokens=8, structured_outputs={"choice": ["yes"]}),
              SamplingParams(max_tokens=10, seed=1, min_tokens=3, allowed_token_ids=[EOS]),  # no grammar
              SamplingParams(max_tokens=10, seed=1, allowed_token_ids=[EOS, 7, 9])]  # fine: 7 and 9 stay samplable
    outs = gen(llm, ["x", "y", "z", "w"], params)
    errors = [out.outputs[0].error for out in outs]
    assert re.fullmatch(r"output 0 of request \d+: token 0 is not in allowed_token_ids: the request's "
                        r"structured_outputs, allowed_token_ids, bad_words and min_tokens \(which bans stop tokens and "
                        r"EOS\) excluded every token at this step", errors[0])
    yes = outs[1].outputs[0]
    assert yes.text == "yes" and "stop token 0 came before min_tokens=8" in yes.error  # the choice, then EOS banned
    assert outs[2].outputs[0].token_ids == [EOS] and "stop token 0 came before min_tokens=3" in errors[2]
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "error", outs[3].outputs[0].finish_reason]
    assert errors[3] is None and set(outs[3].outputs[0].token_ids) <= {EOS, 7, 9}


@pytest.mark.parametrize("fields, match", [
    (dict(), r"exactly one of json, regex, choice, grammar, json_object, structural_tag must be set, got none"),
    (dict(regex="a", choice=["a"]), r"got \['regex', 'choice'\]"),
    (dict(json_object=False), r"got none"),
    (dict(json="{not json"), r"json='\{not json' is not valid JSON"),
    (dict(json="[1, 2]"), r"must be a JSON schema \(an object\)"),
    (dict(json=3), r"json must be a dict or its JSON text, got int"),
    (dict(regex=""), r"regex='' must be a non-empty string"),
    (dict(choice=[]), r"choice=\[\] must be a non-empty list of strings"),
    (dict(choice=["a", 3]), r"choice\[1\]=3 must be a non-empty string"),
    (dict(grammar="root ::= \"a\"", disable_any_whitespace=1), r"disable_any_whitespace=1 must be a bool"),
    (dict(structural_tag="{nope"), r"structural_tag='\{nope' is not valid JSON"),
    (dict(structural_tag=["a"]), r"structural_tag must be a JSON object \(a dict or its text\), got list"),
    (dict(structural_tag={"type": "structural_tag"}), r"needs a 'format' .* got keys \['type'\]"),
    (dict(structural_tag={"structures": [], "triggers": ["<"]}), r"'structures' must be a non-empty list"),
    (dict(structural_tag={"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}),
     r"structures\[0\]=.* must hold 'begin' and 'end' strings and a 'schema'"),
    (dict(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": [""]}),
     r"'triggers' must be a non-empty list of non-empty strings"),
])
def test_bad_constraints_are_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)


@dataclass
class _VllmStyle:  # the shape of vLLM's StructuredOutputsParams (a dataclass with more fields)
    json: object = None
    regex: str | None = None
    choice: list | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


#: the output is one tagged field: ``<f>``, text matching `REGEX`, ``</f>`` (xgrammar's current form)
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "content": {"type": "regex",
                                                                                      "pattern": REGEX},
                                           "end": "</f>"}}
#: vLLM's older form: free text, in which the trigger ``<f=`` opens ``<f=a>`` + a JSON object + ``</f>``
LEGACY_TAG = {"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


def test_structural_tags_constrain_the_output_and_tokens_are_the_definitions(folder):
    """A structural tag (dict or JSON text, xgrammar's form) keeps every sample inside it, each
    token the definition's (its mask xgrammar's for that tag), the logprobs unmasked; vLLM's older
    ``structures`` / ``triggers`` form compiles to free text whose triggered part follows its
    schema."""
    llm = _engine(folder)
    params = [SamplingParams(temperature=t, seed=5 + i, max_tokens=48,
                             structured_outputs={"structural_tag": TAG if i % 2 else json.dumps(TAG)})
              for i, t in enumerate((1.0, 0.0, 0.8, 1.3))]
    outs = gen(llm, ["a", "<f", "{", "x"], params)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.text.startswith("<f>") and c.text.endswith("</f>"), c.text
        assert re.fullmatch(REGEX, c.text[len("<f>"):-len("</f>")]), c.text
        assert c.token_ids == _definition_tokens(llm, out.prompt_token_ids, c.token_ids, p)
        t = p.temperature if p.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs),
                           training_logprobs(llm.model.causal_lm, out.prompt_token_ids, c.token_ids, t))
    legacy = llm._grammars.compile(StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG)))
    assert llm._grammars.matcher(legacy).accept_string('any text <f=a>{"ok": true, "n": 3}</f> more')
    assert not llm._grammars.matcher(legacy).accept_string('any text <f=a>{"ok": 3')
    free = gen(llm, ["a"], SamplingParams(seed=1, max_tokens=8, structured_outputs={"structural_tag": LEGACY_TAG}))
    assert free[0].outputs[0].token_ids  # free text until a trigger
    with pytest.raises(ValueError, match=r"structured_outputs.structural_tag=.* does not compile"):
        gen(llm, ["a"], SamplingParams(structured_outputs={"structural_tag": {"type": "structural_tag",
                                                                                "format": {"type": "nonsense"}}}))


def test_dicts_and_vllms_params_are_taken_and_unsupported_fields_refused():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    taken = SamplingParams(structured_outputs=_VllmStyle(choice=["a", "b"], disable_fallback=True))
    assert taken.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    tagged = SamplingParams(structured_outputs=_VllmStyle(structural_tag=json.dumps(LEGACY_TAG)))
    assert tagged.structured_outputs == StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG))
    with pytest.raises(ValueError, match=r"structured_outputs.whitespace_pattern=' ' is not supported"):
        SamplingParams(structured_outputs=_VllmStyle(regex="a", whitespace_pattern=" "))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['guided'\]"):
        SamplingParams(structured_outputs={"regex": "a", "guided": True})
    with pytest.raises(ValueError, match=r"must be a StructuredOutputsParams, vLLM's, or a dict .* got str"):
        SamplingParams(structured_outputs="a+")


def test_grammars_that_do_not_compile_or_lack_a_tokenizer_are_refused_before_anything_runs(folder):
    llm = _engine(folder)
    for spec, field in (({"regex": "[a-"}, "regex"), ({"grammar": "root ::= undefined_rule"}, "grammar"),
                        ({"json": {"type": "no such type"}}, "json")):
        with pytest.raises(ValueError, match=rf"SamplingParams.structured_outputs.{field}=.* does not compile"):
            gen(llm, ["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, structured_outputs=spec)])
        assert not llm.scheduler.has_unfinished()
    assert gen(llm, ["a"], SamplingParams(max_tokens=2, seed=1))[0].outputs[0].token_ids
    bare = LLM(llm.model.causal_lm, device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs needs a tokenizer"):
        gen(bare, [[3, 4]], SamplingParams(structured_outputs={"regex": "a"}))


def test_choice_grammar_quotes_each_choice():
    assert choice_grammar(CHOICES) == 'root ::= "yes" | "no way" | "say \\"hi\\"\\\\"'
    assert choice_grammar(["😀 é", "a\tb\x01"]) == 'root ::= "😀 é" | "a\\tb\\u0001"'  # (characters kept, controls escaped)


def _accepts(llm: LLM, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether a fresh matcher of `spec` takes `text`'s tokens, then the EOS (the whole output)."""
    [compiled] = llm._compile_grammars([SamplingParams(structured_outputs=spec)])
    matcher = llm._grammars.matcher(compiled)
    return all(matcher.accept_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.accept_token(EOS) and matcher.is_terminated()


def test_choices_outside_the_bmp_with_quotes_or_control_characters_are_themselves(folder):
    """Each choice is its own text in the grammar: a character outside the BMP (one character,
    not the two surrogates of an ASCII escape), quotes, backslashes and control characters; a
    greedy reply held to an emoji choice writes the emoji."""
    llm = _engine(folder)
    choices = ["😀", "naïve 日本", 'say "hi"\\', "tab\there\nx\x01"]
    for choice in choices:
        assert _accepts(llm, StructuredOutputsParams(choice=[choice, "no"]), choice), choice
        assert not _accepts(llm, StructuredOutputsParams(choice=[choice, "no"]), choice[:-1] or "x"), choice
    [out] = gen(llm, ["x"], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["😀"]}))
    assert out.outputs[0].text == "😀" and out.outputs[0].finish_reason == "stop"


def test_json_object_is_an_object_with_or_without_whitespace(folder):
    """``json_object`` (``response_format: {"type": "json_object"}``) is vLLM's: an object, never an
    array or a scalar, even when the model leans to ``[``; ``disable_any_whitespace`` holds it too."""
    llm = _engine(folder)
    spec = StructuredOutputsParams(json_object=True)
    tight = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    assert _accepts(llm, spec, '{"a": [1, {"b": null}]}') and _accepts(llm, spec, '{ "a" :  1 }')
    assert not _accepts(llm, spec, "[1]") and not _accepts(llm, spec, '"s"') and not _accepts(llm, spec, "1")
    assert _accepts(llm, tight, '{"a": 1}') and not _accepts(llm, tight, '{ "a" :  1 }')
    bracket = llm.tokenizer.convert_tokens_to_ids("[")
    [out] = gen(llm, ["x"], SamplingParams(temperature=0.0, max_tokens=40, logit_bias={bracket: 30.0},
                                           structured_outputs=spec))
    assert out.outputs[0].text.startswith("{"), out.outputs[0].text


def test_allowed_tokens_reads_xgrammars_bitmask():
    gen_ = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen_)
    logits = torch.randn(3, 150, generator=gen_)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bits)
    assert torch.equal(torch.where(allowed_tokens(bits, 150), logits, float("-inf")), want)


def test_masks_refuse_a_matcher_behind_its_sequence(folder):
    llm = _engine(folder)
    [compiled] = llm._compile_grammars([SamplingParams(structured_outputs={"regex": "[0-9]+"})])
    seq = Sequence(0, 0, [1, 2], SamplingParams(), 1)
    seq.grammar = GrammarState(llm._grammars.matcher(compiled))
    rows = GrammarRows.of([Sequence(1, 0, [1], SamplingParams(), 1), seq])
    assert rows.rows == [1]
    masks = rows.launch(512, torch.device("cpu"))
    assert masks.bits.shape == (1, 16) and torch.equal(masks.rows, torch.tensor([1]))
    seq.token_ids.append(5)  # an output the matcher never saw
    with pytest.raises(RuntimeError, match=r"its grammar has accepted 0 of its 1 output tokens"):
        rows.launch(512, torch.device("cpu"))


def test_masks_of_a_sequence_finished_since_its_step_went_ahead_allow_every_token(folder):
    """A row whose sequence finished after its step was launched ahead (its result is dropped)
    gets a mask of every token; the running rows get their matchers' masks, in their rows."""
    llm = _engine(folder)
    compiled = llm._compile_grammars([SamplingParams(structured_outputs={"regex": r"[0-9]+"}),
                                      SamplingParams(structured_outputs={"regex": r"\([a-c]\)"})])
    seqs = [Sequence(i, 0, [1, 2], SamplingParams(), 1) for i in range(3)]
    for seq, grammar in zip(seqs, [compiled[0], compiled[1], compiled[0]]):
        seq.grammar = GrammarState(llm._grammars.matcher(grammar))
    alone = GrammarRows.of(seqs).launch(512, torch.device("cpu")).bits
    seqs[1].token_ids.append(5)  # an output its matcher never saw: only a finished row may be behind
    seqs[1].status = SequenceStatus.FINISHED
    bits = GrammarRows.of(seqs).launch(512, torch.device("cpu")).bits
    assert torch.equal(bits[[0, 2]], alone[[0, 2]]) and not torch.equal(alone[0], alone[1])
    assert (bits[1] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_constrained_rows_under_graphs_are_the_eager_engines_and_follow_their_grammar(tmp_path):
    """On CUDA: structured outputs beside unconstrained rows and bad words, with the CUDA graphs (decode and
    mixed steps) and async scheduling on (constrained steps ahead sample after the host), give the
    eager synchronous engine's tokens; every output follows its grammar and its logprobs are the
    training forward's."""
    folder = save_bpe_checkpoint(tmp_path, eos=EOS, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=64)  # a head dim the Triton attention takes
    prompts = ["123-", "(a", '{"ok', "say", "no", "9", "x", "y"]
    params = [_params(i, max_tokens=24) for i in range(6)]
    params += [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True, bad_words=words)
               for s, words in ((1, []), (2, ["yes", "no way"]))]  # (bad words: their bans beside)
    engine = dict(device="cuda", block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    want = gen(LLM(str(folder), enforce_eager=True, async_scheduling=False, **engine), prompts, params)
    llm = LLM(str(folder), **engine)
    got = gen(llm, prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in want]
    assert llm.runner.graphs.mixed_replays > 0
    for i, (out, p) in enumerate(zip(got[:6], params)):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and _follows(SPECS[i % len(SPECS)], c.text), (i, c.text)
        t = p.temperature if p.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs), training_logprobs(llm.model.causal_lm, out.prompt_token_ids,
                                                                       c.token_ids, t))


def test_masks_of_every_row_are_the_indexed_paths():
    gen_ = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen_)
    logits = torch.randn(3, 150, generator=gen_)
    indexed = GrammarMasks(torch.tensor([0, 1, 2]), bits).apply(logits)
    assert torch.equal(GrammarMasks(torch.tensor([0, 1, 2]), bits, every_row=True).apply(logits), indexed)
    some = GrammarMasks(torch.tensor([2]), bits[2:]).apply(logits)
    assert torch.equal(some[:2], logits[:2]) and torch.equal(some[2], indexed[2])
