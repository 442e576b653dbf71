"""The online requests of verl's rollout (`VexactRollout`'s part that `VexactServer` calls): its
requests go to the engine's thread (`runtime.engine_thread`) as online requests, joining the
running batch at the next step, and come back as verl's ``TokenOutput`` when they finish."""

from __future__ import annotations

import queue
from dataclasses import replace

from verl.workers.rollout.replica import TokenOutput

from vexact_models.integrations._verl_support import prompt_scores, sampled_logprobs
from vexact_models.runtime import RequestOutputKind, SamplingParams
from vexact_models.runtime.engine_thread import EngineThread

__all__ = ["RolloutRequests"]


class RolloutRequests:
    """`submit_requests`, `abort_requests` and `poll_requests` over the rollout's ``llm``, for
    `VexactRollout`."""

    global_steps: int | None

    def _init_requests(self) -> None:
        self._engine: EngineThread | None = None  # runs the server's requests (made at the first)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # their outputs, as they finish
        self._wanted: dict[str, tuple[SamplingParams, bool]] = {}  # key -> (params, want logprobs), until polled

    def submit_requests(self, requests: list[tuple[str, list[int], SamplingParams, bool]]) -> list[Exception | None]:
        """Queue ``(key, prompt ids, SamplingParams, want logprobs)`` requests as the engine's online
        requests (its thread, `runtime.engine_thread`, runs them: each joins the running batch at
        the next step); per request its ValueError (bad input, not queued) or None."""
        if self._engine is None:
            self._engine = EngineThread(self.llm)
        errors: list[Exception | None] = []
        for key, ids, params, want_logprobs in requests:
            try:
                self._engine.submit_all([(ids, replace(params, output_kind=RequestOutputKind.FINAL_ONLY))], [key],
                                        self._finished)
            except ValueError as error:
                errors.append(error)
                continue
            self._wanted[key] = (params, want_logprobs)
            errors.append(None)
        return errors

    def abort_requests(self, keys: list[str]) -> None:
        """Stop the requests `keys` now: the next polls return what each generated so far, as
        ``stop_reason="aborted"`` (verl's partial rollouts resume from it)."""
        for key in keys:
            if key in self._wanted:
                self._engine.abort(key)

    def poll_requests(self, wait_s: float) -> list[tuple[str, TokenOutput | Exception]]:
        """The requests that finished since the last poll, as ``(key, TokenOutput)`` (or the
        exception of a failed one), waiting up to `wait_s` seconds for the first."""
        try:
            items = [self._finished.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while not self._finished.empty():
            items.append(self._finished.get())
        results: list[tuple[str, TokenOutput | Exception]] = []
        for item in items:
            if isinstance(item, BaseException):  # the engine failed a step and dropped every request
                results += [(key, item) for key in self._wanted]
                self._wanted.clear()
            elif item.request_id in self._wanted:
                results.append((item.request_id, self._token_output(item, *self._wanted.pop(item.request_id))))
        return results

    def _token_output(self, out, params: SamplingParams, want_logprobs: bool) -> TokenOutput | Exception:
        """verl's ``TokenOutput`` of a finished request (an exception when the engine failed it)."""
        c = out.outputs[0]
        if c.finish_reason == "error":
            return RuntimeError(f"vexact engine: {c.error}")
        stop_reason = "aborted" if c.finish_reason == "abort" else "completed"
        extra = {"global_steps": self.global_steps}
        if params.prompt_logprobs is not None:  # verl's distillation teacher reads these
            extra["prompt_ids"], extra["prompt_logprobs"] = prompt_scores(out.prompt_logprobs, params.prompt_logprobs)
        return TokenOutput(token_ids=list(c.token_ids), log_probs=sampled_logprobs(c) if want_logprobs else None,
                           stop_reason=stop_reason, num_preempted=None, extra_fields=extra)
