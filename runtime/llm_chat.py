"""`LLM.chat`: conversations through the tokenizer's chat template, then `LLM.generate`, as vLLM's
``LLM.chat`` takes them.

The template renders each conversation to text (``apply_chat_template``, the generation prompt
added), which is tokenized without the tokenizer's own special tokens (the template writes them:
a second BOS would change the prompt) and rolled out as token ids; each `RequestOutput` carries the
rendered text as its ``prompt``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from .llm_args import resolve_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["ChatMixin", "chat_ids", "render_text"]


class ChatMixin:
    """`chat` and vLLM's tokenizer accessors, for `LLM` (it uses the engine's ``tokenizer`` and
    ``generate``)."""

    def get_tokenizer(self):
        """The engine's tokenizer (the checkpoint folder's, or ``LLM(tokenizer=...)``'s; None
        without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Use `tokenizer` (a transformers tokenizer, or a folder / hub id to load one from) for
        text prompts, returned text and stop strings from the next call on, as vLLM's
        ``LLM.set_tokenizer``; a ValueError naming it, changing nothing, when it is neither."""
        if tokenizer is None:
            raise ValueError("LLM.set_tokenizer: tokenizer must be a transformers tokenizer or a folder or hub id, "
                             "got None")
        self.tokenizer = resolve_tokenizer(tokenizer)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to `messages`: one conversation (a list of ``{"role", "content"}``
        dicts) or a list of them, rendered by the tokenizer's chat template (or `chat_template`),
        with `tools` and `chat_template_kwargs` passed to it (e.g. ``{"enable_thinking": False}``).
        `sampling_params` as in `generate`. A ValueError, before any work, without a tokenizer,
        for a message that is not a dict with a role and a content, or a tokenizer without a chat
        template."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template: load a checkpoint folder that has one, "
                             "or pass LLM(..., tokenizer=...)")
        conversations = [messages] if isinstance(messages, Seq) and messages and isinstance(messages[0], Mapping) \
            else list(messages)
        texts = [self._render(i, conversation, chat_template, add_generation_prompt, continue_final_message, tools,
                              chat_template_kwargs or {}) for i, conversation in enumerate(conversations)]
        prompts = [{"prompt_token_ids": chat_ids(self.tokenizer, text)} for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def _render(self, index: int, conversation, chat_template, add_generation_prompt: bool,
                continue_final_message: bool, tools, kwargs: dict) -> str:
        """The text of conversation `index`, after checking its messages."""
        return render_text(self.tokenizer, conversation, chat_template, add_generation_prompt, continue_final_message,
                           tools, kwargs, "LLM.chat", f"conversation {index}")


def render_text(tokenizer, conversation, chat_template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, tools, kwargs: dict, caller: str, where: str) -> str:
    """`conversation` rendered by `tokenizer`'s chat template (or `chat_template`), after checking
    its messages: a ValueError naming `caller`, `where` (the conversation) and the message otherwise.
    An assistant message's ``tool_calls`` may stand for its content; their ``arguments``, JSON text
    in OpenAI's messages, reach the template as the objects they encode (as vLLM passes them:
    templates write them out with ``tojson``), and its ``reasoning`` as ``reasoning_content``."""
    if not isinstance(conversation, Seq) or isinstance(conversation, str) or not conversation:
        raise ValueError(f"{caller}: {where} must be a non-empty list of messages, got {conversation!r}")
    for j, message in enumerate(conversation):
        if not isinstance(message, Mapping) or "role" not in message or ("content" not in message
                                                                          and not message.get("tool_calls")):
            raise ValueError(f"{caller}: message {j} of {where} must be a dict with 'role' and 'content' (or "
                             f"'tool_calls'), got {message!r}")
    return tokenizer.apply_chat_template(
        [_template_message(message) for message in conversation], tokenize=False, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
        **kwargs)


def _template_message(message: Mapping) -> Mapping:
    """`message` as chat templates read it (a copy where it changes): its tool calls' JSON-text
    ``arguments`` decoded, and the ``reasoning`` a server returned (vLLM's field) also given as
    the ``reasoning_content`` that templates re-render (Qwen3's, Qwen3.5's) and the ``thinking``
    GPT-OSS's template writes into its analysis channel."""
    if isinstance(message.get("reasoning"), str) and "reasoning_content" not in message:
        message = {**message, "reasoning_content": message["reasoning"]}
    if isinstance(message.get("reasoning_content"), str) and "thinking" not in message:
        message = {**message, "thinking": message["reasoning_content"]}
    calls = message.get("tool_calls")
    if not isinstance(calls, Seq) or not all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                                             for c in calls):
        return message  # (none, or not OpenAI's form: the template gets them as they are)
    decoded = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text
        decoded.append({**call, "function": function})
    return {**message, "tool_calls": decoded}


def chat_ids(tokenizer, text: str) -> list[int]:
    """A rendered conversation's token ids: the template wrote its special tokens, so the
    tokenizer adds none."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
