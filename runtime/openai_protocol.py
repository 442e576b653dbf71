"""The OpenAI API's request bodies read into the engine's requests, and its outputs written back as
the API's responses and stream chunks (`runtime.openai_server` serves them).

Read as vLLM's server reads them: OpenAI's fields (``max_tokens``, ``temperature``, ``top_p``,
``n``, ``stop``, ``seed``, the two penalties, ``logit_bias``, ``logprobs``, ``response_format``,
``stream`` with ``stream_options.include_usage``) and vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``spaces_between_special_tokens``, ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words``, ``structured_outputs`` and its older ``guided_*`` fields
(`runtime.openai_structured`), ``truncate_prompt_tokens`` (`runtime.openai_context`),
``return_token_ids``, and for chat ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, and the tools: ``tools``, ``tool_choice``,
``parallel_tool_calls``, `runtime.openai_tools`). ``logit_bias`` values are clamped to OpenAI's
[-100, 100], as vLLM clamps them. A field of the wrong type or value is a `ProtocolError` (HTTP
400) naming it; fields the engine has no counterpart for (``suffix``, ``best_of`` above ``n``, a
chat's ``echo``, and vLLM's ``use_beam_search``, ``logits_processors``,
``return_tokens_as_token_ids``, ``add_special_tokens``, a chat's ``chat_template``, away from
their defaults) are refused the same way rather than ignored. Other unknown fields are ignored,
as OpenAI's clients send some (``user``, ``metadata``, vLLM's ``guided_decoding_backend``).

The prompt's own logprobs (`SamplingParams.prompt_logprobs`, the training forward's floats too):
a completion's ``echo`` returns the prompt before the reply, its tokens' logprobs first (None for
the first token) when ``logprobs`` is asked, and with ``max_tokens: 0`` the prompt alone (how
lm-evaluation-harness scores a text); vLLM's ``prompt_logprobs: k`` returns them per position as
``{token_id: {logprob, rank, decoded_token}}`` dicts, on each completion choice (in a stream's
first chunk) or on a chat response.

Each returned logprob is the engine's float, written by ``json`` exactly (it round-trips), so a
client reads the bits the training forward recomputes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .grammar_masks import grammar_trigger
from .openai_context import check_context, truncate_prompts
from .openai_errors import ProtocolError
from .openai_structured import structured_outputs
from .openai_tools import ChatStream, ToolReply, chat_message, read_tools
from .outputs import CompletionOutput, RequestOutput
from .reasoning import HARMONY, reasoning_block, reply_parser
from .sampling_params import RequestOutputKind, SamplingParams
from .structured_outputs import StructuredOutputsConfig, StructuredOutputsParams
from .top_logprobs import Logprob

__all__ = ["ProtocolError", "EngineRequest", "read_completion", "read_chat", "completion_choice", "chat_choice",
           "chat_stream", "prompt_logprobs", "response", "sampling_field", "usage"]

#: vLLM's sampling fields read as they are, with the types they must have
_EXTRA_FIELDS = {"top_k": int, "min_p": (int, float), "repetition_penalty": (int, float), "min_tokens": int,
                 "ignore_eos": bool, "stop_token_ids": list, "skip_special_tokens": bool,
                 "include_stop_str_in_output": bool, "allowed_token_ids": list, "bad_words": list,
                 "spaces_between_special_tokens": bool}
#: vLLM's fields that the engine has no counterpart for, at the values it answers as vLLM does
_FIXED_FIELDS = {"use_beam_search": False, "logits_processors": None, "return_tokens_as_token_ids": False}
_OPENAI_FIELDS = {"temperature": (int, float), "top_p": (int, float), "n": int, "seed": int,
                  "presence_penalty": (int, float), "frequency_penalty": (int, float)}


@dataclass
class EngineRequest:
    """What one API request asks of the engine: its prompts (token ids), one `SamplingParams`
    per prompt, and how to answer."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    top_logprobs: int | None = None  #: alternatives per position asked for (None: no logprobs)
    #: each token id's text (the server's tokenizer), for the logprobs of requests asking k = 0
    token_texts: Callable[[list[int]], list[str]] | None = None
    tools: ToolReply | None = None  #: a chat request's tool calls to read from its reply (None: text)
    #: the reasoning parser that splits a chat reply (`runtime.reasoning.reply_parser`; None: all answer)
    reasoning: str | None = None
    include_reasoning: bool = True  #: vLLM's field: False drops the reasoning from the reply
    echo: bool = False  #: a completion's prompt returned before its reply
    prompt_only: bool = False  #: ``echo`` with ``max_tokens: 0``: the one token sampled is not returned
    prompt_logprobs: int | None = None  #: ``prompt_logprobs`` asked for (returned as vLLM's field)
    #: each prompt's text, for ``echo`` (None where given as token ids: the server decodes them)
    prompt_texts: list[str | None] | None = None
    id: str = ""
    created: int = 0


def _typed(body: dict, name: str, kinds, default=None):
    """``body[name]`` (`default` when absent or null), a ProtocolError unless one of `kinds` (a
    bool is no int here)."""
    value = body.get(name, default)
    if value is None or value is default:
        return value
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"'{name}' must be a {' or '.join(k.__name__ for k in kinds)}, got {value!r}", name)
    return value


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None, stream: bool,
              structured: StructuredOutputsParams | None = None, prompt_logprobs: int | None = None,
              keep_special_tokens: bool = False, after_reasoning: tuple[str, str] | None = None,
              config: StructuredOutputsConfig = StructuredOutputsConfig()) -> SamplingParams:
    """The request's `SamplingParams` (each field checked by it too: its ValueError names the field);
    `structured`: the structured output its tools ask for, else the body's, under the server's
    `config`; `keep_special_tokens`: the reply is decoded with its special tokens, whatever the
    body says; `after_reasoning`: the reasoning block after which a structured output holds the
    reply (the server's reasoning parser's)."""
    fields = {name: _typed(body, name, kinds) for name, kinds in {**_OPENAI_FIELDS, **_EXTRA_FIELDS}.items()}
    fields = {name: value for name, value in fields.items() if value is not None}
    if keep_special_tokens:
        fields["skip_special_tokens"] = False
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    bias = _typed(body, "logit_bias", dict)
    if bias:
        fields["logit_bias"] = _logit_bias(bias)
    try:
        # k = 0 asks for the sampled tokens' logprobs alone: the engine's floats, no alternatives to rank
        # (a request's own structured_outputs keeps the fields it names: after_reasoning null holds the whole reply)
        given = None if structured is not None else body.get("structured_outputs")
        structured = structured or structured_outputs(body)
        if structured is not None:
            structured = config.apply(structured, after_reasoning, given)
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs or None, prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured,
                              output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except ProtocolError:  # (a ValueError that names its field already)
        raise
    except ValueError as err:
        raise ProtocolError(str(err), sampling_field(str(err))) from None


def _logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias`` as the engine's: token ids, each bias clamped to OpenAI's range
    [-100, 100] (vLLM's ``SamplingParams.from_optional``)."""
    try:
        tokens = [int(token) for token in bias]
    except ValueError:
        raise ProtocolError(f"'logit_bias' keys must be token ids, got {sorted(bias)!r}", "logit_bias") from None
    for token, value in bias.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProtocolError(f"'logit_bias' values must be numbers, got {value!r} for token {token}", "logit_bias")
    return {token: min(100.0, max(-100.0, float(value))) for token, value in zip(tokens, bias.values())}


def sampling_field(message: str) -> str:
    """The field a `SamplingParams` ValueError names (``SamplingParams.NAME=...``, ``NAME[i]=...``)."""
    return message.split("=")[0].removeprefix("SamplingParams.").split("[")[0]




def _refuse(body: dict, chat: bool = False) -> None:
    """A `ProtocolError` for a field the engine has no counterpart for, at a value that would
    change the output (vLLM's fields at their defaults are taken: clients send some)."""
    fixed = {**_FIXED_FIELDS, "add_special_tokens": not chat, **({"chat_template": None} if chat else {})}
    for name, default in fixed.items():
        if body.get(name, default) != default:
            raise ProtocolError(f"'{name}'={body[name]!r} is not supported (only {json.dumps(default)})", name)
    if body.get("suffix"):
        raise ProtocolError("'suffix' is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ProtocolError(f"'best_of'={best_of!r} is not supported (only best_of = n)", "best_of")


def _options(body: dict) -> dict:
    stream = bool(_typed(body, "stream", bool, False))
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise ProtocolError("'stream_options' can only be given with 'stream': true", "stream_options")
    options = options or {}
    return dict(stream=stream, include_usage=bool(stream and options.get("include_usage")),
                return_token_ids=bool(_typed(body, "return_token_ids", bool, False)),
                id=uuid.uuid4().hex, created=int(time.time()))


def read_completion(body: dict, tokenize, config: StructuredOutputsConfig = StructuredOutputsConfig(),
                    max_model_len: int | None = None) -> EngineRequest:
    """A ``/v1/completions`` body: ``prompt`` a string, token ids, or a list of either; `config`:
    the server's structured-outputs defaults; `max_model_len`: the engine's, which each prompt and
    ``max_tokens`` (default 16) must fit together (None: not checked here)."""
    _refuse(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ProtocolError("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(tokenize(item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prompts.append(list(item))
        else:
            raise ProtocolError(f"'prompt' items must be strings or lists of token ids, got {item!r}", "prompt")
    prompts = truncate_prompts(body, prompts, max_model_len)
    logprobs = _typed(body, "logprobs", int)
    max_tokens = _typed(body, "max_tokens", int, 16)
    echo = bool(_typed(body, "echo", bool, False))
    asked = _typed(body, "prompt_logprobs", int)
    scored = asked if not (echo and logprobs is not None) else max(asked or 0, logprobs)  # echo shows the prompt's
    prompt_only = echo and max_tokens == 0  # (one token is sampled, as vLLM does, and not returned)
    if max_model_len is not None and not prompt_only:
        check_context(max(map(len, prompts)), max_tokens, max_model_len)
    options = _options(body)
    params = _sampling(body, 1 if prompt_only else max_tokens, logprobs, options["stream"], prompt_logprobs=scored,
                       config=config)
    return EngineRequest(prompts, [params] * len(prompts), top_logprobs=logprobs, echo=echo, prompt_only=prompt_only,
                         prompt_logprobs=asked, prompt_texts=[p if isinstance(p, str) else None for p in prompt],
                         **options)


def read_chat(body: dict, render, max_model_len: int, tool_parser: str | None = None,
              reasoning_parser: str | None = None, config: StructuredOutputsConfig = StructuredOutputsConfig(),
              tokenizer=None) -> EngineRequest:
    """A ``/v1/chat/completions`` body; `render` turns (messages, template options) into token ids;
    `tool_parser` and `reasoning_parser`: the server's (`runtime.tool_calls.PARSERS`,
    `runtime.reasoning.PARSERS`, checked by `OpenAIServer`), None for none; `tokenizer`: the
    server's, which reads whether the prompt closed its reasoning block (thinking off: a ``qwen3``
    reply is then all answer, as its grammar holds it from the first token; None: not read)."""
    _refuse(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list of messages", "messages")
    if body.get("echo"):
        raise ProtocolError("'echo' is not supported on chat completions ('return_token_ids' returns the prompt's "
                            "tokens)", "echo")
    tools = read_tools(body, tool_parser)
    kwargs = _typed(body, "chat_template_kwargs", dict) or {}
    ids = render(messages, add_generation_prompt=_typed(body, "add_generation_prompt", bool, True),
                       continue_final_message=_typed(body, "continue_final_message", bool, False),
                       tools=body.get("tools"), chat_template_kwargs=kwargs)
    [ids] = truncate_prompts(body, [ids], max_model_len)
    wanted = _typed(body, "logprobs", bool, False)
    top = _typed(body, "top_logprobs", int)
    if top is not None and not wanted:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    k = (top or 0) if wanted else None
    max_tokens = _typed(body, "max_completion_tokens", int) or _typed(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(ids))  # vLLM's default: up to the context length
    else:
        check_context(len(ids), max_tokens, max_model_len)
    options = _options(body)
    asked = _typed(body, "prompt_logprobs", int)
    if asked is not None and options["stream"]:
        raise ProtocolError("'prompt_logprobs' is returned by chat completions that are not streamed", "prompt_logprobs")
    # a grammar (the calls', the request's own) starts after the reasoning; a harmony reply's messages
    # are read from their special tokens (`runtime.harmony`)
    block = None if reasoning_parser is None else reasoning_block(reasoning_parser)
    params = _sampling(body, max_tokens, k, options["stream"], tools.structured() if tools else None, asked,
                       keep_special_tokens=reasoning_parser == HARMONY, after_reasoning=block, config=config)
    include = bool(_typed(body, "include_reasoning", bool, True))
    closed = tokenizer is not None and block is not None and grammar_trigger(tokenizer, block, ids) is None
    return EngineRequest([ids], [params], top_logprobs=k, tools=tools, prompt_logprobs=asked,
                         reasoning=reply_parser(reasoning_parser, closed), include_reasoning=include, **options)


# -- responses ---------------------------------------------------------------------------------
def _positions(request: EngineRequest, completion: CompletionOutput) -> list[tuple[str, float, list[Logprob]]]:
    """Per output token: its text, its logprob, and its position's k most probable entries (rank
    order); with k = 0 the engine's floats, the texts from the request's tokenizer."""
    if not completion.token_ids or isinstance(completion.logprobs[0], float):
        return list(zip(request.token_texts(completion.token_ids), completion.logprobs, [[]] * len(completion.token_ids)))
    return [_ranked(request, token, entries) for token, entries in zip(completion.token_ids, completion.logprobs)]


def _ranked(request: EngineRequest, token: int, entries: dict[int, Logprob]) -> tuple[str, float, list[Logprob]]:
    top = sorted((e for e in entries.values() if e.rank <= request.top_logprobs), key=lambda e: e.rank)
    return entries[token].decoded_token or "", entries[token].logprob, top


def _prompt_positions(request: EngineRequest, output: RequestOutput) -> list[tuple[str, float | None, list | None]]:
    """`_positions` of the prompt (``echo``): its first token has no logprob."""
    ids = output.prompt_token_ids
    first = (request.token_texts(ids[:1])[0], None, None)
    return [first] + [_ranked(request, token, entries) for token, entries in zip(ids[1:], output.prompt_logprobs[1:])]


def _completion_logprobs(positions: list, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for text, logprob, top in positions:
        tokens.append(text)
        values.append(logprob)
        # the token and the k best (None at the prompt's first token)
        tops.append(None if top is None else {text: logprob, **{e.decoded_token or "": e.logprob for e in top}})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(output: RequestOutput) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: None for the first prompt token, then per token a dict
    ``{token_id: {"logprob", "rank", "decoded_token"}}``."""
    return [None if entries is None else {str(token): {"logprob": e.logprob, "rank": e.rank,
                                                        "decoded_token": e.decoded_token} for token, e in entries.items()}
            for entries in output.prompt_logprobs]


def _chat_logprobs(request: EngineRequest, completion: CompletionOutput) -> dict:
    def item(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(text, logprob), "top_logprobs": [item(e.decoded_token or "", e.logprob) for e in top]}
                        for text, logprob, top in _positions(request, completion)]}


def _token_fields(request: EngineRequest, output: RequestOutput, completion: CompletionOutput) -> dict:
    if not request.return_token_ids:
        return {}
    return {"token_ids": completion.token_ids, "prompt_token_ids": output.prompt_token_ids}


def completion_choice(request: EngineRequest, index: int, output: RequestOutput, completion: CompletionOutput,
                      offset: int = 0, first: bool = True) -> dict:
    """One ``/v1/completions`` choice (or a stream chunk's: `completion` a delta, `first` whether
    it is the choice's first chunk, which echoes the prompt)."""
    if request.prompt_only:  # echo of the prompt alone: the token sampled is not returned
        completion = CompletionOutput(completion.index, [], [], completion.finish_reason and "length", "")
    text = completion.text or ""
    positions = None if request.top_logprobs is None else _positions(request, completion)
    extra = {}
    if first and request.echo:
        text = request.prompt_texts[index // request.params[0].n] + text
        positions = None if positions is None else _prompt_positions(request, output) + positions
    if first and request.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs(output)
    logprobs = None if positions is None else _completion_logprobs(positions, offset)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason, **_token_fields(request, output, completion), **extra}


def chat_stream(request: EngineRequest) -> ChatStream | bool:
    """What a streamed chat choice's deltas need: its `ChatStream` where the reply is split
    (reasoning, tools), else True (the text as it comes)."""
    if request.tools is None and request.reasoning is None:
        return True
    return ChatStream(request.tools, request.reasoning, request.include_reasoning)


def _reply_text(request: EngineRequest, completion: CompletionOutput) -> str:
    """A chat reply's text as the server reads it: a harmony reply's with the token that ended it
    (``<|return|>``, ``<|call|>``), which the engine's text leaves out, as vLLM's, and harmony's
    reader reads (`runtime.harmony`)."""
    text = completion.text or ""
    if (request.reasoning == HARMONY and completion.finish_reason == "stop" and completion.token_ids
            and not isinstance(completion.stop_reason, str) and not request.params[0].include_stop_str_in_output):
        text += request.token_texts(completion.token_ids[-1:])[0]
    return text


def chat_choice(request: EngineRequest, index: int, output: RequestOutput, completion: CompletionOutput,
                stream: ChatStream | bool = False) -> dict:
    """One ``/v1/chat/completions`` choice: a whole message, or (`stream`: the choice's
    `chat_stream`) a stream chunk's delta."""
    logprobs = None if request.top_logprobs is None else _chat_logprobs(request, completion)
    text, finish = _reply_text(request, completion), completion.finish_reason
    if isinstance(stream, ChatStream):
        message = stream.delta(text, finish is not None)
        finish = "tool_calls" if finish is not None and stream.called else finish
    elif stream:
        message = {"content": text}
    elif request.tools is not None or request.reasoning is not None:
        message, called = chat_message(text, request.tools, request.reasoning, request.include_reasoning)
        finish = "tool_calls" if called else finish
    else:
        message = {"role": "assistant", "content": text}
    return {"index": index, "delta" if stream is not False else "message": message, "logprobs": logprobs,
            "finish_reason": finish, "stop_reason": completion.stop_reason, **_token_fields(request, output, completion)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: EngineRequest, kind: str, model: str, choices: list[dict], usage_: dict | None) -> dict:
    """A response (`kind` ``text_completion``, ``chat.completion``) or a chunk (``chat.completion.chunk``)."""
    body = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{request.id}", "object": kind,
            "created": request.created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
