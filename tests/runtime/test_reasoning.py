"""A chat reply's reasoning split from its answer (`runtime.reasoning`: vLLM's ``qwen3``,
``deepseek_r1`` and ``minimax_m2`` parsers), whole and streamed, and with the reply's tool calls read from the answer
alone (`runtime.openai_tools.ChatStream`, `chat_message`)."""

import pytest

from vexact_models.runtime.openai_tools import ChatStream, ToolReply, chat_message
from vexact_models.runtime.reasoning import reasoning_split, split_reasoning
from vexact_models.runtime.tool_calls import PARSERS

from .stream_support import join_deltas

TEXTS = ["<think>a plan</think>\n\nthe answer", "the answer alone", "<think>cut short", "a plan</think>answer",
         "<thin", "<think></think>", "a </thinking> b </think> c", "</think>"]


@pytest.mark.parametrize("text, split", [
    ("<think>a plan</think>\n\nthe answer", ("a plan", "\n\nthe answer")),
    ("the answer alone", ("the answer alone", None)),  # (cut short before </think>: all reasoning)
    ("<think>cut short", ("cut short", None)),
    ("a plan</think>answer", ("a plan", "answer")),  # (the prompt opened the block, as Qwen3.5's template does)
    ("<thin", ("<thin", None)),
])
def test_whole_replies_split_by_parser(text, split):
    """The ``<think>`` parsers split a reply alike: reasoning until ``</think>`` (vLLM's current
    ``qwen3`` parser reads a block the prompt opened, as ``deepseek_r1`` does)."""
    assert split_reasoning("qwen3", text) == split_reasoning("deepseek_r1", text) == split
    assert split_reasoning("minimax_m2", text) == split
    assert split_reasoning("minimax_m2_append_think", text) == (None, "<think>" + text)  # (vLLM's answer)


def test_qwen3_splits_at_the_end_its_grammar_waits_for_and_a_closed_prompt_makes_all_answer(tmp_path):
    """``--reasoning-parser qwen3``: the answer begins where the grammar after the reasoning begins
    (after ``</think>``, whether or not the reply opened the block), and after a prompt that
    closed its block (thinking off) the reply is all answer, the grammar holding it from its first
    token: the server's split and its grammar read the prompt alike."""
    import transformers

    from vexact_models.runtime.grammar_masks import GrammarState, grammar_trigger
    from vexact_models.runtime.openai_protocol import read_chat

    from .llm_support import save_bpe_checkpoint

    tok = transformers.AutoTokenizer.from_pretrained(save_bpe_checkpoint(tmp_path, added_tokens=("<think>", "</think>")))
    block, body = ("<think>", "</think>"), {"messages": [{"role": "user", "content": "x"}]}
    for prompt, reply, want in (("user: x <think>", 'a plan</think>{"a": 1}', ("a plan", '{"a": 1}')),
                                ("user: x ", '<think>a plan</think>{"a": 1}', ("a plan", '{"a": 1}')),
                                ("user: x <think>\n\n</think>\n\n", '{"a": 1}', (None, '{"a": 1}'))):
        ids = tok.encode(prompt, add_special_tokens=False)
        request = read_chat(body, lambda messages, **kw: ids, 64, None, "qwen3", tokenizer=tok)  # noqa: B023
        message, _ = chat_message(reply, None, request.reasoning)
        assert (message.get("reasoning"), message["content"]) == want, prompt
        state, tokens = GrammarState(None, grammar_trigger(tok, block, ids)), tok.encode(reply, add_special_tokens=False)
        while not state.active:  # (the tokens before the trigger: no matcher fed)
            state.accept(tokens[state.accepted])
        assert tok.decode(tokens[state.accepted:]) == want[1], prompt  # (the grammar holds the answer, all of it)
    assert split_reasoning("qwen3", "abc</think>xyz") == ("abc", "xyz")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1", "minimax_m2", "minimax_m2_append_think"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_split(parser, text):
    """Fed a character at a time (tags split over deltas), the pieces join to the whole split."""
    split = reasoning_split(parser)
    pieces = [split.feed(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    reasoning, answer = split_reasoning(parser, text)
    assert "".join(p[0] for p in pieces) == (reasoning or "") and "".join(p[1] for p in pieces) == (answer or "")


def test_reasoning_then_tool_calls_whole_and_streamed():
    text = '<think>call it</think>ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    tools = ToolReply("auto", [{"type": "function", "function": {"name": "f"}}], PARSERS["hermes"]())
    message, called = chat_message(text, tools, "qwen3")
    assert called and message["reasoning"] == "call it" and message["content"] == "ok "
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    stream = ChatStream(tools, "qwen3")
    deltas = [stream.delta(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    assert "".join(d.get("reasoning", "") for d in deltas) == "call it"
    assert "".join(d.get("content", "") for d in deltas) == "ok "
    assert [c["function"] for c in join_deltas(deltas)["tool_calls"]] == [message["tool_calls"][0]["function"]]
    assert stream.called


def test_minimax_m2_reasoning_then_invokes():
    """MiniMax-M2's template opens the think block in the prompt: the reply reasons until
    ``</think>``, then its answer holds the calls; with ``minimax_m2_append_think`` the think block
    stays in the content, before the calls."""
    text = 'plan it</think>\n\nok<minimax:tool_call><invoke name="f"><parameter name="x">1</parameter></invoke>'
    tools = ToolReply("auto", [{"type": "function", "function": {"name": "f"}}], PARSERS["minimax_m2"]())
    message, called = chat_message(text, tools, "minimax_m2")
    assert called and message["reasoning"] == "plan it" and message["content"] == "\n\nok"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": "1"}'}
    kept, called = chat_message(text, tools, "minimax_m2_append_think")
    assert called and "reasoning" not in kept and kept["content"] == "<think>plan it</think>\n\nok"
    stream = ChatStream(tools, "minimax_m2_append_think")
    deltas = [stream.delta(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    assert "".join(d.get("content", "") for d in deltas) == kept["content"]
    assert [c["function"] for c in join_deltas(deltas)["tool_calls"]] == [kept["tool_calls"][0]["function"]]


def test_include_reasoning_false_drops_it():
    assert chat_message("<think>x</think>y", None, "qwen3", include_reasoning=False) == (
        {"role": "assistant", "content": "y"}, False)
    stream = ChatStream(None, "deepseek_r1", include_reasoning=False)
    assert [stream.delta(t, last) for t, last in (("x", False), ("</think>", False), ("y", True))] == [
        {}, {}, {"content": "y"}]


def test_a_grammar_starts_after_the_reasoning():
    """tool_choice "required", a named function, a response_format: the reply reasons first, free,
    and the grammar holds it after the parser's reasoning block (vLLM's order); the reply is split.
    A request's own ``structured_outputs`` that names ``after_reasoning`` (null: the whole reply)
    keeps it; without a reasoning parser the grammar holds the whole reply."""
    from vexact_models.runtime.openai_protocol import read_chat

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    render = lambda messages, **kw: [5]  # noqa: E731
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        request = read_chat({**body, "tool_choice": choice}, render, 64, "hermes", "deepseek_r1")
        assert request.reasoning == "deepseek_r1"
        assert request.params[0].structured_outputs.after_reasoning == ("<think>", "</think>")
        assert read_chat({**body, "tool_choice": choice}, render, 64, "hermes").params[0].structured_outputs.after_reasoning \
            is None
    own = {"messages": body["messages"], "response_format": {"type": "json_object"}}
    harmony = read_chat(own, render, 64, "openai", "openai_gptoss").params[0]
    assert harmony.structured_outputs.after_reasoning == ("<|start|>", "<|channel|>final<|message|>")
    assert harmony.skip_special_tokens is False
    whole = {"messages": body["messages"], "structured_outputs": {"regex": "a+", "after_reasoning": None}}
    assert read_chat(whole, render, 64, "hermes", "qwen3").params[0].structured_outputs.after_reasoning is None
