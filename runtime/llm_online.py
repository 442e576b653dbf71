"""`LLM`'s online requests, as vLLM's ``LLMEngine``: `add_request` queues a request at any time,
`step` runs one engine step and returns what it produced, `abort_request` drops requests.

``generate`` takes a call's requests and runs them to completion; a server (`runtime.openai_server`,
``vexact serve``) or an agent loop gets requests one at a time, while others run. Here a request
joins the running batch at the next step, and leaves it when it finishes: the same scheduler,
step loop (``EngineStepsMixin._advance``, one step launched ahead of the host) and sampler as
``generate``. A request's tokens and logprobs depend only on its prompt, its parameters and its
seed (rules 1 and 7), so they are bitwise those ``generate`` gives it alone, and those the
training forward recomputes, whatever ran beside it.

What ``generate`` settles once per call is settled when the engine goes from idle to busy (the
first request added while none runs): whether pages published earlier may be shared
(``LLM._keep_prefix_cache``), the kernel backend, and the CUDA graphs following it. So while online
requests run, ``generate``, ``update_weights``, ``sleep``, ``wake_up`` and ``reset_prefix_cache``
raise RuntimeError: they would change the weights or the cache under them, or run their steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vexact_models.kernels import use_backend

from .engine_lock import one_call_at_a_time
from .llm_args import prompt_of
from .outputs import CompletionOutput, RequestOutput
from .progress import progress_bar
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduled import ScheduledSeq
from .sequence import Sequence
from .stop_strings import stop_holdback
from .text_deltas import TextDeltas

__all__ = ["OnlineRequestsMixin"]


@dataclass
class _Request:
    """An online request: what its outputs are made of, and what DELTA outputs returned so far."""

    index: int  #: the engine's request number (``Sequence.request_id``: seeds derive from it)
    prompt: object
    ids: list[int]
    seqs: list[Sequence]
    sent: list[int]  #: per sample, the output tokens returned (DELTA)
    reported: list[bool]  #: per sample, whether its finish was returned (DELTA)
    texts: list[TextDeltas] | None  #: per sample, its text so far (DELTA with text)


class OnlineRequestsMixin:
    """`LLM`'s ``add_request`` / ``step`` / ``abort_request`` (the module docstring)."""

    _online: dict[str, _Request]  #: the unfinished online requests by their callers' ids, in arrival order

    def _init_online(self) -> None:
        self._online = {}
        self._by_index: dict[int, str] = {}
        self._errored_at_add: list[str] = []  # requests that can never fit: reported by the next step
        self._online_backend: str | None = None
        self._online_bar = progress_bar(0, False)

    # -- the public interface ---------------------------------------------------------------
    @one_call_at_a_time
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue `prompt` (token ids, text with a tokenizer, or vLLM's prompt dict) as request
        `request_id` (a string no unfinished request has), sampled with `params` (default
        ``SamplingParams()``); it joins the running batch at the next `step`. Its seed, when
        ``params.seed`` is None, derives from the engine's ``seed`` and the order requests
        arrive in (``generate``'s included). Bad input raises ValueError before anything is
        queued, as ``generate`` checks it."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"LLM.add_request: request_id={request_id!r} must be a non-empty string")
        if request_id in self._online:
            raise ValueError(f"LLM.add_request: request_id={request_id!r} is already an unfinished request")
        if self.pipeline is not None:
            raise ValueError("LLM.add_request: pipeline-parallel engines run whole calls (generate on every rank)")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"LLM.add_request: params must be a SamplingParams, got {type(params).__name__}")
        self._check_awake("LLM.add_request")
        ids = self._token_ids(prompt, params)
        self._check_params([params])
        grammar, bad_words = self._compile_grammars([params])[0], self._bad_words([params])[0]
        if not self._online:
            self._begin_online()
        index = self._next_request
        seqs = self._make_sequences(index, ids, params, grammar, bad_words)
        self._next_request += 1
        self._scores_prompts = self._scores_prompts or params.prompt_logprobs is not None
        for seq in seqs:
            self.scheduler.add(seq)
        self._online[request_id] = _Request(index, prompt, ids, seqs, [0] * params.n, [False] * params.n,
                                            self._text_deltas(params))
        self._by_index[index] = request_id
        if seqs[0].is_finished:  # it can never fit (Scheduler.add): finished with its error
            self._errored_at_add.append(request_id)

    @one_call_at_a_time
    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Stop the unfinished requests `request_id` (one id or several) now: their pages are freed
        at once, `step` returns nothing more of them, and this returns their last outputs (as their
        ``output_kind`` makes them, ``finished``; samples still running end with finish_reason
        "abort", their tokens so far kept: what verl's partial rollouts resume from). Ids of no
        unfinished request are ignored, as vLLM's are (a request may finish before its abort)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        requests = [(name, self._online.pop(name)) for name in dict.fromkeys(ids) if name in self._online]
        self.scheduler.abort(seq for _, request in requests for seq in request.seqs)
        outputs = []
        for name, request in requests:
            del self._by_index[request.index]
            outputs.append(self._request_output(name, request, True))
        self._errored_at_add = [name for name in self._errored_at_add if name in self._online]
        if not self._online:
            with self._dropping_all_on_failure():
                self._drain()
        return outputs

    @one_call_at_a_time
    def step(self) -> list[RequestOutput]:
        """Run one engine step over the online requests and return their outputs, as each one's
        ``params.output_kind`` asks (`RequestOutputKind`; ``RequestOutput.finished`` says whether
        it finished). An idle engine returns []. A step whose logits are not finite raises
        RuntimeError and drops every online request, as a failed ``generate`` drops its own."""
        if not self._online:
            return []
        with self._dropping_all_on_failure(), use_backend(self._online_backend):
            outputs = self._step_outputs(self._advance(self._online_bar))
            if not self._online:
                self._drain()
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether online requests are queued or running (vLLM's name)."""
        return bool(self._online)

    def get_num_unfinished_requests(self) -> int:
        """How many online requests are queued or running (vLLM's name)."""
        return len(self._online)

    # -- engine state ------------------------------------------------------------------------
    def _check_no_online(self, caller: str) -> None:
        """RuntimeError while online requests run (the module docstring says why)."""
        if self._online:
            raise RuntimeError(f"{caller}: {len(self._online)} requests added by add_request are unfinished; step() "
                               "until has_unfinished_requests() is False, or abort_request them, first")

    def _begin_online(self) -> None:
        """The engine goes from idle to busy: settle what ``generate`` settles for a call."""
        backend = self._online_backend = self.backend
        if not self._keep_prefix_cache(backend):
            self.scheduler.reset_prefix_cache()
        self._scores_prompts = False
        self._last_completion = time.perf_counter()  # (step_times: the interval to the first step)
        self.sampler.begin_call(True)
        with use_backend(backend):
            self._graphs_follow(backend)

    @contextlib.contextmanager
    def _dropping_all_on_failure(self):
        """A step that raises (non-finite logits, an interrupt) leaves the engine as a failed
        ``generate`` does: every online request dropped, the scheduler fresh (``LLM._abort``)."""
        try:
            yield
        except BaseException:
            self._abort()
            self._online.clear()
            self._by_index.clear()
            self._errored_at_add.clear()
            raise

    def _drain(self) -> None:
        """No online request is left: complete the step launched ahead, if one is in flight (its
        rows all belong to finished or aborted sequences and are dropped)."""
        while self._launched is not None or self.scheduler.has_unfinished():
            with use_backend(self._online_backend):
                self._advance(self._online_bar)

    # -- outputs -----------------------------------------------------------------------------
    def _text_deltas(self, params: SamplingParams) -> list[TextDeltas] | None:
        if params.output_kind is not RequestOutputKind.DELTA or self.tokenizer is None or not params.detokenize:
            return None
        return [TextDeltas(self.tokenizer, params.decode_options, stop_holdback(params)) for _ in range(params.n)]

    def _step_outputs(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """The outputs of the requests that got tokens in the completed step (or errored when
        added), in arrival order; finished requests are forgotten."""
        names = set(self._errored_at_add)
        self._errored_at_add = []
        by_index = self._by_index
        names.update(by_index[item.seq.request_id] for item in scheduled
                     if item.samples and item.seq.request_id in by_index)
        outputs = []
        for name in sorted(names, key=lambda n: self._online[n].index):
            request = self._online[name]
            finished = all(seq.is_finished for seq in request.seqs)
            output = self._request_output(name, request, finished)
            if output is not None:
                outputs.append(output)
            if finished:
                del self._online[name], by_index[request.index]
        return outputs

    def _request_output(self, name: str, request: _Request, finished: bool) -> RequestOutput | None:
        kind = request.seqs[0].params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is not RequestOutputKind.DELTA:
            output = self._output(request.prompt, request.ids, request.seqs)
        else:
            text = prompt_of(request.prompt)
            first = not any(request.sent) and not any(request.reported)
            output = RequestOutput(request.index, text if isinstance(text, str) else None, request.ids,
                                   self._deltas(request), self._prompt_scores(request.seqs[0]) if first else None)
        output.request_id, output.finished = name, finished
        return output

    def _deltas(self, request: _Request) -> list[CompletionOutput]:
        """Each sample's tokens, logprobs and text new since the last output, its finish reason and
        cumulative logprob once it finishes (samples with nothing new are left out)."""
        deltas = []
        for i, seq in enumerate(request.seqs):
            start, done = request.sent[i], seq.is_finished
            if seq.num_output_tokens == start and (not done or request.reported[i]):
                continue
            delta = self._completion(seq, start, whole=done)
            if request.texts is not None:
                texts = request.texts[i]
                delta.text = texts.finish(delta.text) if done else texts.feed(seq.output_token_ids)
            request.sent[i], request.reported[i] = seq.num_output_tokens, done
            deltas.append(delta)
        return deltas
