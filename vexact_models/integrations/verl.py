"""verl integration: a rollout backend (``rollout.name=vexact``) and the actor's logprob hook.

Importing this module registers everything (`install`), which is what verl's external-module
mechanisms do in each of its processes::

    export VERL_USE_EXTERNAL_MODULES=vexact_models.integrations.verl   # or model.external_lib=...
    python -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.name=vexact \\
        actor_rollout_ref.model.use_fused_kernels=True actor_rollout_ref.rollout.calculate_log_probs=True

Then verl loads our training classes (`vexact_models.patch`), rolls out with our paged engine
(`VexactRollout` in each worker, reached through `VexactServer` / `VexactReplica`) and computes
the actor's logprobs with `token_logprobs`' kernel, so ``training/rollout_probs_diff_max`` is 0.
See ``docs/verl.md``.

- `VexactRollout` (verl's ``BaseRollout``): owns one `vexact_models.runtime.LLM` per rank
  (tensor/data/pipeline parallel size 1); ``resume(tags)`` / ``release()`` wake / sleep it,
  ``update_weights`` streams the trainer's full tensors into it (MoE experts re-fused), or with
  unmerged LoRA its adapters alone (the engine's model takes adapters of verl's ``peft_config``).
- `VexactServer`: the replica's server; its async ``generate(prompt_ids, sampling_params,
  request_id, ...)`` returns verl's ``TokenOutput`` with ``log_probs``, and with
  ``prompt_logprobs`` the prompt's scores in ``extra_fields`` (what verl's distillation teacher
  reads, so a replica of ours can be the teacher). Each request joins the engine's running batch as
  it arrives (the engine's online requests; batch-invariant kernels: batching changes no token).
- The actor hook: our causal LMs' ``forward`` honours verl's fused-kernel contract
  (``temperature=``, ``shift_labels=`` -> ``log_probs``, ``entropy``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterable

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from vexact_models.integrations._verl_support import (OPTIONS_KEY, OWN_OPTIONS, check_parallel, engine_options,
                                                      max_model_len_of, request_seed)
from vexact_models.integrations._verl_support import sampling_params as to_sampling_params
from vexact_models.integrations import _verl_registry
from vexact_models.integrations._verl_requests import RolloutRequests
from vexact_models.integrations._verl_weights import RolloutWeights
from vexact_models.integrations._verl_registry import ROLLOUT_NAME, uninstall
from vexact_models.runtime import LLM

__all__ = ["ROLLOUT_NAME", "VexactReplica", "VexactRollout", "VexactServer", "install", "uninstall"]

_ADAPTERS: dict[int, "VexactRollout"] = {}  # replica rank -> the engine living in this process


class VexactRollout(RolloutRequests, RolloutWeights, BaseRollout):
    """verl's rollout contract over one `LLM` in this process (the trainer's rank, or a
    checkpoint-engine worker). The engine is built on first use from ``model_config.local_path``
    (its own full copy of the weights, which the trainer's ``update_weights`` refreshes), or over
    `model` when given (sharing its weights: a single-process loop or a test).

    Args:
        config: verl's ``RolloutConfig`` (``dtype``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``gpu_memory_utilization``, ``enforce_eager``, ``seed``,
            ``enable_chunked_prefill``, ``enable_prefix_caching``, ``free_cache_engine`` are
            honoured; ``engine_kwargs.vexact`` adds `LLM` arguments, ``sleep_level`` (what
            `release` frees: 0 KV cache, 1 also weights to host, 2 also drops them; default 2, as
            every wake-up is followed by ``update_weights``).
        model_config: verl's ``HFModelConfig``.
        device_mesh: unused (one engine per rank).
        replica_rank: this engine's replica; default the process's ``RANK``.
        model: a training-variant model to roll out from instead of loading the checkpoint.
    """

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1, *, model=None,
                 **kwargs) -> None:
        super().__init__(config, model_config, device_mesh)
        check_parallel(self.config)
        opts = engine_options(self.config)
        self.sleep_level = int(opts.pop("sleep_level", OWN_OPTIONS["sleep_level"]))
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.engine_kwargs.{OPTIONS_KEY}.sleep_level={self.sleep_level} must be 0, 1 or 2")
        self.replica_rank = int(os.environ.get("RANK", 0)) if replica_rank < 0 else int(replica_rank)
        self.is_leader_rank = True  # asked by verl's checkpoint-engine worker
        self.global_steps: int | None = None
        self._model = model
        self._llm_kwargs = opts
        self._llm: LLM | None = None
        self._lora: dict | None = None  # the LoRA config (`lora_fields`) of the adapters the engine holds
        self._init_requests()
        _ADAPTERS[self.replica_rank] = self

    @property
    def llm(self) -> LLM:
        """The engine (built on first use)."""
        if self._llm is None:
            cfg = self.config
            kwargs = dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_model_len=max_model_len_of(cfg), gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enforce_eager=cfg.enforce_eager, enable_chunked_prefill=cfg.enable_chunked_prefill,
                          enable_prefix_sharing=cfg.enable_prefix_caching,
                          seed=request_seed(cfg.seed, self.replica_rank, "engine"))  # replicas sample apart
            if self._model is None:
                kwargs["dtype"] = cfg.dtype
            kwargs.update(self._llm_kwargs)
            source = self._model if self._model is not None else self.model_config.local_path
            self._llm = LLM(source, **kwargs)
        return self._llm

    # -- verl's BaseRollout ----------------------------------------------------------------
    async def resume(self, tags: list[str]) -> None:
        """Wake the engine's ``"weights"`` and/or ``"kv_cache"`` (when ``free_cache_engine``)."""
        if self.config.free_cache_engine:
            self.wake_up(tags)

    async def release(self) -> None:
        """Free the engine's device memory per ``sleep_level`` (when ``free_cache_engine``)."""
        if self.config.free_cache_engine:
            self.sleep()

    # -- what the server calls (synchronous: it runs them in a thread or on the worker actor) --
    def sleep(self, level: int | None = None) -> None:
        """Free device memory (`sleep_level` unless given; see `LLM.sleep`)."""
        if self._llm is not None:
            self._llm.sleep(level=self.sleep_level if level is None else level)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what `sleep` freed (``tags``: ``"weights"`` and/or ``"kv_cache"``)."""
        self.llm.wake_up(tags=None if tags is None else list(tags))

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps


def _on_worker(actor, replica_rank: int, method: str, args: tuple):
    """Run on the Ray actor hosting replica `replica_rank`'s `VexactRollout` (via ``__ray_call__``)."""
    adapter = _ADAPTERS.get(replica_rank)
    if adapter is None:
        raise RuntimeError(f"no VexactRollout for replica {replica_rank} in this process (is "
                           f"actor_rollout_ref.rollout.name={ROLLOUT_NAME!r} and vexact_models.integrations.verl imported "
                           "there?)")
    return getattr(adapter, method)(*args)


class VexactServer:
    """A replica's server: what verl's ``LLMServerClient`` and ``RolloutReplica`` call.

    It reaches its `VexactRollout` in this process (`rollout`) or on the Ray actor hosting it
    (``workers[0]``). Each request goes to the engine as an online request as soon as it arrives
    (`VexactRollout.submit_requests`: it joins the running batch at the next step), and its answer
    comes back when it finishes (`VexactRollout.poll_requests`, which the server calls while
    requests are out, a wait of at most `POLL_S` each)."""

    #: the longest one poll of the rollout waits for a request to finish (new requests are
    #: submitted between polls)
    POLL_S = 0.01

    def __init__(self, config, workers: list | None = None, replica_rank: int = 0, *,
                 rollout: VexactRollout | None = None, **kwargs) -> None:
        self.config = omega_conf_to_dataclass(config)
        if rollout is None and not workers:
            raise ValueError("VexactServer: pass rollout= (in-process engine) or workers= (the Ray actor hosting it)")
        self.replica_rank = int(replica_rank)
        self._local = rollout
        self._worker = None if rollout is not None else workers[0]
        engine_options(self.config)  # its errors (a removed option) before the first request
        self.max_model_len = max_model_len_of(self.config)
        self._queue: list = []  # ((key, ids, params, want logprobs), future) not submitted yet
        self._pending: dict[str, asyncio.Future] = {}  # submitted, not finished
        self._keys = itertools.count()
        self._runner: asyncio.Task | None = None
        self._loop = None  # the event loop the primitives below belong to (made there, on first use)
        self._lock: asyncio.Lock | None = None  # one call into the rollout at a time
        self._open: asyncio.Event | None = None  # admission gate (closed by abort_all_requests)
        self._reject = False

    def _loop_state(self) -> tuple[asyncio.Lock, asyncio.Event]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a Ray actor has one loop; in-process callers may use several
            self._loop, self._lock, self._open = loop, asyncio.Lock(), asyncio.Event()
            self._open.set()
        return self._lock, self._open

    async def _call(self, method: str, *args):
        lock, _ = self._loop_state()
        async with lock:
            if self._local is not None:
                return await asyncio.to_thread(getattr(self._local, method), *args)
            return await self._worker.__ray_call__.remote(_on_worker, self.replica_rank, method, args)

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str, image_data=None,
                       video_data=None, audio_data=None, mm_processor_kwargs=None, priority: int = 0,
                       **kwargs) -> TokenOutput:
        """Token-in, token-out generation of one request; ``log_probs`` when
        ``sampling_params['logprobs']`` asks (verl: ``rollout.calculate_log_probs``; the sampled
        tokens' logprobs, also for ``logprobs=k``), and with ``sampling_params['prompt_logprobs']``
        the prompt's scores in ``extra_fields['prompt_ids']`` / ``['prompt_logprobs']``
        (`prompt_scores`: verl's distillation teacher)."""
        if image_data or video_data or audio_data or mm_processor_kwargs:  # verl sends None or [] for text
            raise ValueError("VexactServer.generate: multimodal input is not supported")
        if kwargs:
            raise ValueError(f"VexactServer.generate: unsupported argument(s) {sorted(kwargs)}")
        ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        seed = request_seed(self.config.seed, self.replica_rank, request_id) if self.config.full_determinism else None
        params, want_logprobs = to_sampling_params(sampling_params, len(ids), self.config,
                                                   max_model_len=self.max_model_len, seed=seed)
        _, gate = self._loop_state()
        if self._reject and not gate.is_set():
            return _aborted()
        future = asyncio.get_running_loop().create_future()
        key = f"{request_id}#{next(self._keys)}"  # verl's ids are not promised unique among running requests
        self._queue.append(((key, ids, params, want_logprobs), future))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        """Submit what arrived (while the gate is open), poll for what finished; until nothing is out."""
        _, gate = self._loop_state()
        try:
            while self._queue or self._pending:
                if self._queue and gate.is_set():
                    batch, self._queue = self._queue, []
                    await self._submit(batch)
                if self._pending:
                    await self._poll()
                elif self._queue:  # held by abort_all_requests until resume_generation
                    await gate.wait()
        finally:
            self._runner = None

    async def _submit(self, batch: list) -> None:
        try:
            errors = await self._call("submit_requests", [request for request, _ in batch])
        except Exception as error:  # the call itself failed (e.g. the engine is asleep): each caller hears why
            errors = [error] * len(batch)
        for (request, future), error in zip(batch, errors):
            if error is not None:
                if not future.done():
                    future.set_exception(error)
            else:
                self._pending[request[0]] = future

    async def _poll(self) -> None:
        try:
            results = await self._call("poll_requests", self.POLL_S)
        except Exception as error:  # the rollout is gone: every request out hears why
            results = [(key, error) for key in self._pending]
        for key, result in results:
            future = self._pending.pop(key, None)
            if future is None or future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    # -- engine control (verl's RolloutReplica and checkpoint manager call these) ------------
    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def sleep(self) -> None:
        """Free the engine's memory (`VexactRollout.sleep`); nothing without ``free_cache_engine``,
        as verl's vLLM server: verl's weight sync then wakes nothing either."""
        if self.config.free_cache_engine:
            await self._call("sleep")

    async def release_kv_cache(self) -> None:
        """Free the KV cache for a weight sync (only with ``free_cache_engine``, as verl's vLLM server)."""
        if self.config.free_cache_engine:
            await self._call("sleep", 0)

    async def resume_kv_cache(self) -> None:
        """Restore what `release_kv_cache` freed (only with ``free_cache_engine``)."""
        if self.config.free_cache_engine:
            await self._call("wake_up", ["kv_cache"])

    async def clear_kv_cache(self) -> None:
        """Nothing to do: an engine over verl's weights shares no prefix pages once its requests
        finished (`LLM._keep_prefix_cache`), and its own copy drops them at every weight update."""

    async def set_global_steps(self, global_steps: int) -> None:
        await self._call("set_global_steps", global_steps)

    async def wait_for_requests_to_drain(self) -> None:
        """Return once every submitted request has finished (queued ones held by the gate stay)."""
        _, gate = self._loop_state()
        while self._pending or (self._queue and gate.is_set()):
            await asyncio.sleep(self.POLL_S)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """As verl's vLLM server: hold new requests until `resume_generation` and stop the running
        ones now, each answered ``stop_reason="aborted"`` with what it generated so far (tokens and
        logprobs: verl's partial rollouts resume from them); with `reject_request` queued requests and
        those arriving meanwhile come back ``aborted`` and empty. The engine keeps no pages of
        weights about to change (`LLM._keep_prefix_cache`), so `reset_prefix_cache` asks nothing more."""
        _, gate = self._loop_state()
        gate.clear()
        self._reject = bool(reject_request)
        rejected = []
        if self._reject:  # queued requests that have not started: answer them now
            rejected, self._queue = self._queue, []
            _answer_aborted(rejected)
        stopped = list(self._pending)
        if stopped:
            await self._call("abort_requests", stopped)
        await self.wait_for_requests_to_drain()
        ids = [_request_id(key) for key in stopped] + [_request_id(request[0]) for request, _ in rejected]
        return {"aborted_count": len(ids), "request_ids": ids}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        """Stop request `request_id` now (answered ``aborted`` with what it generated so far; a
        queued one, empty), as verl's vLLM server does."""
        queued = [entry for entry in self._queue if _request_id(entry[0][0]) == request_id]
        self._queue = [entry for entry in self._queue if entry not in queued]
        _answer_aborted(queued)
        running = [key for key in self._pending if _request_id(key) == request_id]
        if running:
            await self._call("abort_requests", running)
        return {"aborted": bool(queued or running), "request_id": request_id}

    async def resume_generation(self) -> None:
        _, gate = self._loop_state()
        self._reject = False
        gate.set()

    async def start_profile(self, **kwargs) -> None:
        """Profiling is not wired up: a no-op."""

    async def stop_profile(self) -> None:
        """Profiling is not wired up: a no-op."""


def _aborted() -> TokenOutput:
    """What a request stopped before it started gets (verl's vLLM server's answer); a new one each
    time, since callers may change what they get."""
    return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted")


def _answer_aborted(queued: list) -> None:
    """Answer queued ``(request, future)`` entries that will not run: `_aborted`."""
    for _, future in queued:
        if not future.done():
            future.set_result(_aborted())


def _request_id(key: str) -> str:
    """verl's request id of a server key (``VexactServer.generate`` makes ``f"{request_id}#{n}"``)."""
    return key.rsplit("#", 1)[0]


class VexactReplica(RolloutReplica):
    """verl's replica for ``rollout.name=vexact``: one rank, one `VexactServer` (a Ray actor on
    the node of the worker that hosts the replica's `VexactRollout`)."""

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8, *args, **kwargs) -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, *args, **kwargs)
        check_parallel(self.config)

    async def launch_servers(self) -> None:
        """Start the server actor for this replica's worker."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if len(self.workers) != 1:
            raise RuntimeError(f"VexactReplica {self.replica_rank}: expected 1 worker, got {len(self.workers)}")
        worker = self.workers[0]
        node_id = await worker.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id())
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        name = f"{ROLLOUT_NAME}_server_{role}{self.replica_rank}{self.name_suffix}"
        server = ray.remote(VexactServer).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            name=name, max_concurrency=self.max_concurrency,
        ).remote(config=self.config, workers=[worker], replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}://{name}"  # no HTTP endpoint: token-in/token-out only


def install() -> None:
    """Register the backend and the hook with verl (idempotent; importing this module calls it):
    ``rollout.name=vexact`` in verl's rollout and replica registries (`VexactRollout`,
    `VexactReplica`), `vexact_models.patch` (verl loads our classes), our causal LMs' ``forward``
    answering verl's fused-kernel call, and verl's fused-kernel monkey patch leaving that forward
    alone. `uninstall` undoes it."""
    _verl_registry.install(VexactReplica)


install()
