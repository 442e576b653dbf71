"""A grammar that starts after the reasoning (``StructuredOutputsParams.after_reasoning``,
`runtime.grammar_masks`): the output is free until the model writes the reasoning's end, then
held to the grammar; every token is the one the definition picks (no mask before the end's
tokens, the grammar's mask fed the tokens after them); a prompt that closed its reasoning block
holds the output from the first token; a request's tokens do not depend on its batch, the cache,
preemption or the graphs (rule 7)."""

import dataclasses
import json
import re

import pytest
import torch

from vexact_models.runtime import LLM, SamplingParams, StructuredOutputsParams
from vexact_models.runtime.grammar_masks import GrammarState, Trigger, grammar_trigger

from .llm_support import (gen, sampled_by_definition, save_bpe_checkpoint, tokens_four_ways, training_logits,
                          training_logprobs)

xgr = pytest.importorskip("xgrammar")  # (the test extra has it; the compat venvs do not)

EOS = 0
REGEX = r"(yes|no way)"
THINK = ("<think>", "</think>")
BIAS = 4.5  # on "</think>": the reasoning ends after a few free tokens
SEED = 1  # (a seed whose JSON closes within max_tokens: a random model pads it with whitespace)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 checkpoint whose tokenizer has ``<think>`` and ``</think>`` as whole tokens
    (not special, as Qwen3's)."""
    return save_bpe_checkpoint(tmp_path_factory.mktemp("after_reasoning"), eos=EOS, added_tokens=THINK)


@pytest.fixture(scope="module")
def llm(folder):
    return _engine(folder)


def _engine(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{**dict(device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_batched_tokens=64),
                               **kwargs})


def _params(llm: LLM, seed: int, **extra) -> SamplingParams:
    end = llm.tokenizer.convert_tokens_to_ids(THINK[1])
    extra.setdefault("max_tokens", 40)
    return SamplingParams(temperature=1.0, seed=seed, logit_bias={end: BIAS},
                          structured_outputs=StructuredOutputsParams(regex=REGEX, after_reasoning=THINK), **extra)


def _definition_tokens(llm: LLM, prompt: list[int], tokens: list[int], p: SamplingParams) -> list[int]:
    """Each output position's token by the definition: the training forward's logits, masked by a
    matcher fed the outputs after the reasoning's end once it was written (unmasked before), the
    bias added, then the sampler's definition."""
    x = training_logits(llm.model.causal_lm, prompt, tokens)
    found = grammar_trigger(llm.tokenizer, THINK, prompt)
    trigger = () if found is None else found.end
    matcher = llm._grammars.matcher(llm._grammars.compile(p.structured_outputs))
    bits = xgr.allocate_token_bitmask(1, x.shape[1])
    held = not trigger
    for i, token in enumerate(tokens):
        if held:
            matcher.fill_next_token_bitmask(bits, 0)
            row = x[i:i + 1].clone()
            xgr.apply_token_bitmask_inplace(row, bits)
            x[i] = row[0]
            assert matcher.accept_token(token)
        held = held or tuple(tokens[max(0, i + 1 - len(trigger)):i + 1]) == trigger
    for token, bias in p.logit_bias.items():
        x[:, token] += bias
    return sampled_by_definition(x, prompt, tokens, p)


def test_the_output_is_free_until_the_reasoning_ends_then_follows_the_grammar(llm):
    prompts = ["yes", "no", "9", "a", "say", "way", "x", "1"]
    params = [_params(llm, 80 + i) for i in range(len(prompts))]
    free = 0
    for out, p in zip(gen(llm, prompts, params), params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS, c.text
        reasoning, _, answer = c.text.partition(THINK[1])
        assert re.fullmatch(REGEX, answer), c.text
        free += bool(reasoning) and not re.fullmatch(REGEX, reasoning)
        assert c.token_ids == _definition_tokens(llm, out.prompt_token_ids, c.token_ids, p)
    assert free >= 3  # outputs that reasoned freely first (the bias ends most reasoning within a few tokens)


def test_a_prompt_that_closed_its_reasoning_block_is_held_from_the_first_token(llm):
    p = _params(llm, 5)
    [out] = gen(llm, ["<think>hm</think>"], p)
    c = out.outputs[0]
    assert re.fullmatch(REGEX, c.text) and c.token_ids[-1] == EOS
    assert c.token_ids == _definition_tokens(llm, out.prompt_token_ids, c.token_ids, p)
    [opened] = gen(llm, ["x</think> then <think>"], p)  # (its last block is open: the reasoning goes on)
    assert THINK[1] in opened.outputs[0].text


def test_rows_that_wait_for_their_reasoning_do_not_depend_on_their_batch_the_cache_or_the_steps(folder):
    make = lambda **kw: _engine(folder, **kw)  # noqa: E731
    llm = make()
    prompts = ["yes", "no", "9", "a", "say", "<think>x</think>", "x"]
    params = [_params(llm, 90 + i, max_tokens=24) for i in range(6)]
    params.append(SamplingParams(temperature=1.0, max_tokens=12, seed=3))  # an unconstrained row beside them
    batch, alone, tight, replayed = tokens_four_ways(make, prompts, params, 10)
    assert batch == alone == tight == replayed


def test_grammar_state_waits_for_its_trigger():
    class Matcher:
        def __init__(self):
            self.fed = []

        def accept_token(self, token):
            self.fed.append(token)
            return token != 99

        def is_terminated(self):
            return True

    state = GrammarState(Matcher(), Trigger((7, 8)))
    assert not state.active and not state.terminated
    assert all(state.accept(t) for t in (99, 7, 5, 8, 7))  # (anything goes while it waits)
    assert not state.active and state.matcher.fed == []
    assert state.accept(8) and state.active and state.accepted == 6 and state.terminated
    assert state.accept(1) and not state.accept(99) and state.matcher.fed == [1, 99] and state.accepted == 7


def test_grammar_trigger_reads_the_prompts_last_reasoning_block(llm):
    tok = llm.tokenizer
    end = tuple(tok.encode(THINK[1], add_special_tokens=False))

    def trigger(text: str) -> tuple[int, ...]:
        return grammar_trigger(tok, THINK, tok.encode(text, add_special_tokens=False))

    assert trigger("yes") == Trigger(end) and trigger("yes <think>") == Trigger(end)
    assert trigger("<think>a</think><think>b") == Trigger(end)
    assert trigger("<think>a</think>") is None and trigger("<think></think> yes") is None
    assert trigger("a</think>") == Trigger(end)  # (an end without its start closes nothing)
    assert grammar_trigger(tok, None, [1, 2]) is None


HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>")
HARMONY_BLOCK = ("<|start|>", "<|channel|>final<|message|>")


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory):
    """A tiny checkpoint whose tokenizer has harmony's markers as special tokens, as GPT-OSS's."""
    return save_bpe_checkpoint(tmp_path_factory.mktemp("harmony"), eos=EOS, special_tokens=HARMONY_TOKENS)


def test_harmonys_final_header_starts_the_grammar_with_a_content_type_before_its_message(harmony_folder):
    """As vLLM's GPT-OSS parser: the grammar starts after ``<|message|>`` when it begins within 20
    tokens of ``<|channel|>final`` (``<|channel|>final <|constrain|>json<|message|>``), not after
    an analysis header or a ``<|message|>`` too far from it; a prompt that wrote such a header
    holds the reply from its first token, and one that ends inside it waits for its ``<|message|>``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(harmony_folder)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = ids("<|start|>user<|message|>hi<|end|><|start|>assistant")

    def starts(reply: str, prompt: list[int] = prompt) -> int | None:
        """How many of the reply's tokens come before the grammar holds it (None: never)."""
        state = GrammarState(None, grammar_trigger(tok, HARMONY_BLOCK, prompt))
        for token in ids(reply):
            if state.active:
                break
            state.accept(token)
        return state.accepted if state.active else None

    analysis = "<|channel|>analysis<|message|>think<|end|><|start|>assistant"
    assert starts(analysis + "<|channel|>final<|message|>") == len(ids(analysis)) + 7
    assert starts(analysis + "<|channel|>final <|constrain|>json<|message|>{") == len(ids(analysis + "<|channel|>final "
                                                                                          "<|constrain|>json<|message|>"))
    assert starts(analysis) is None and starts("<|channel|>final" + " ok" * 20 + "<|message|>") is None
    assert starts("<|channel|>final <|constrain|>json" + "<|message|>") == len(ids("<|channel|>final <|constrain|>json")) + 1
    written = prompt + ids("<|channel|>final <|constrain|>json<|message|>")
    assert grammar_trigger(tok, HARMONY_BLOCK, written) is None
    assert starts("<|message|>{", prompt + ids("<|channel|>final <|constrain|>json")) == 1
    assert grammar_trigger(tok, HARMONY_BLOCK, written + ids("{}<|end|><|start|>assistant")) is not None


def test_a_harmony_prompt_that_opened_a_typed_final_message_is_held_from_the_first_token(harmony_folder):
    llm = _engine(harmony_folder)
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=REGEX, after_reasoning=HARMONY_BLOCK))
    [out] = gen(llm, ["<|start|>assistant<|channel|>final <|constrain|>json<|message|>"], p)
    c = out.outputs[0]
    assert re.fullmatch(REGEX, c.text) and c.token_ids[-1] == EOS, c.text


@pytest.mark.parametrize("pair", [("<think>",), ["", "</think>"], "</think>", ("<think>", 3)])
def test_after_reasoning_must_be_two_texts(pair):
    with pytest.raises(ValueError, match="StructuredOutputsParams.after_reasoning=.* must be two non-empty strings"):
        StructuredOutputsParams(regex=REGEX, after_reasoning=pair)
    assert StructuredOutputsParams.of({"regex": REGEX, "after_reasoning": list(THINK)}).after_reasoning == THINK


def test_logprobs_stay_the_unmasked_ones(llm):
    """Before and after the reasoning's end, the reported logprobs are the training forward's."""
    [out] = gen(llm, ["say"], _params(llm, 7))
    c = out.outputs[0]
    assert THINK[1] in c.text
    assert torch.equal(torch.tensor(c.logprobs), training_logprobs(llm.model.causal_lm, out.prompt_token_ids,
                                                                   c.token_ids, 1.0))


def test_the_servers_required_calls_follow_the_reasoning(folder):
    """``vexact serve --reasoning-parser deepseek_r1``: tool_choice "required" lets the reply reason
    freely, then holds it to the calls' JSON; the reasoning comes back as ``reasoning``, the calls
    as calls, and the tokens are those ``LLM.chat`` samples with the same grammar after the same
    reasoning block."""
    openai = pytest.importorskip("openai")
    from vexact_models.runtime.openai_server import OpenAIServer
    from vexact_models.runtime.openai_tools import ToolReply

    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"word": {"enum": ["yes", "no"]}}, "required": ["word"],
        "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "say"}]
    llm = _engine(folder, kv_cache_bytes=1 << 22)
    end = llm.tokenizer.convert_tokens_to_ids(THINK[1])
    server = OpenAIServer(llm, "tiny", port=0, reasoning_parser="deepseek_r1", chat_template=template).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False,
            max_tokens=300, seed=SEED, temperature=1.0, logit_bias={str(end): BIAS}, extra_body={"return_token_ids": True})
    finally:
        server.close()
    choice = reply.choices[0]
    structured = dataclasses.replace(ToolReply("required", tools, parallel=False).structured(), after_reasoning=THINK)
    want = _engine(folder, kv_cache_bytes=1 << 22).chat(
        messages, SamplingParams(temperature=1.0, max_tokens=300, seed=SEED, logit_bias={end: BIAS},
                                 structured_outputs=structured), chat_template=template, use_tqdm=False)[0].outputs[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    thought, _, calls = want.text.partition(THINK[1])
    assert thought and choice.message.model_extra["reasoning"] == thought and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments) == json.loads(calls)[0]["parameters"]


def test_a_row_waiting_for_its_reasoning_allows_every_token(llm):
    """Beside rows held by their grammar, a row whose grammar waits for its trigger gets a mask
    of every token, until the trigger's tokens arrive."""
    from vexact_models.runtime.grammar_masks import GrammarRows
    from vexact_models.runtime.sequence import Sequence

    compiled = llm._compile_grammars([SamplingParams(structured_outputs={"regex": r"[0-9]+"})])[0]
    seqs = [Sequence(i, 0, [1, 2], SamplingParams(), 1) for i in range(2)]
    for seq, trigger in zip(seqs, [None, Trigger((7, 8))]):
        seq.grammar = GrammarState(llm._grammars.matcher(compiled), trigger)
    bits = GrammarRows.of(seqs).launch(llm.config.vocab_size, torch.device("cpu")).bits
    assert (bits[1] == -1).all() and not (bits[0] == -1).all()
    for token in (7, 8):
        seqs[1].token_ids.append(token)
        assert seqs[1].grammar.accept(token)
    bits = GrammarRows.of(seqs).launch(llm.config.vocab_size, torch.device("cpu")).bits
    assert torch.equal(bits[1], bits[0])  # (both matchers fresh: the same regex's first mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_rows_waiting_for_their_reasoning_under_graphs_are_the_eager_engines(tmp_path):
    """On CUDA, with the CUDA graphs and async scheduling on: rows whose grammar starts after the
    reasoning, beside held and unconstrained rows, give the eager synchronous engine's tokens and
    logprobs, and each answer follows the grammar."""
    folder = save_bpe_checkpoint(tmp_path, eos=EOS, added_tokens=THINK, hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=64)  # a head dim the Triton attention takes
    engine = dict(device="cuda", block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    eager = LLM(str(folder), enforce_eager=True, async_scheduling=False, **engine)
    prompts = ["yes", "no", "9", "a", "<think>x</think>", "x"]
    params = [_params(eager, 60 + i, max_tokens=32) for i in range(5)]
    params.append(SamplingParams(temperature=1.0, max_tokens=24, seed=3))
    want = gen(eager, prompts, params)
    llm = LLM(str(folder), **engine)
    got = gen(llm, prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in want]
    assert llm.runner.graphs.mixed_replays > 0
    for out in got[:5]:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert re.fullmatch(REGEX, c.text.rpartition(THINK[1])[2] if THINK[1] in c.text else c.text), c.text
    assert sum(THINK[1] in o.outputs[0].text for o in got[:5]) >= 2
