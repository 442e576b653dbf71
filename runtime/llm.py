"""LLM: the rollout engine's front end, in the style of vLLM's ``LLM``.

    llm = LLM("path/to/checkpoint")                 # or LLM(training_model) to share weights
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=256, seed=0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs

Each step: `Scheduler.schedule` -> `ModelRunner.execute` -> `Sampler` -> `Scheduler.postprocess`
(`llm_steps`: the loop, which with ``async_scheduling`` launches the next decode step before
reading the current one's tokens back).

Where the engine's parts live: this file holds construction and ``generate`` (requests in,
outputs out; `llm_requests` turns prompts into sequences and sequences into outputs, `llm_chat`
renders conversations first); `llm_args` checks the constructor's arguments before anything changes;
`llm_setup` holds the functions that pick the device, load a checkpoint folder and size the KV
cache; `engine_lock` lets one call run at a time. Two parts are mixins of the one class rather
than objects of their own, because they act on the engine's own state: `llm_steps`
(`EngineStepsMixin`, the step loop over the engine's scheduler, which a failed call replaces,
and the switches users set on the engine) and `llm_memory` (`EngineMemoryMixin`: the public
``update_weights``, ``sleep`` and ``wake_up``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import torch

from vexact_models.adapters import adapter_state
from vexact_models.hub_config import checkpoint_folder
from vexact_models.kernels import EXPERT_B, attention_forward_mode, current_backend, use_backend
from vexact_models.projections import fuse_projections

from .block_manager import BlockManager
from .engine_lock import EngineLock, one_call_at_a_time
from .llm_args import (architecture_of, check_engine_args, check_max_model_len, check_model_argument,
                       check_model_placement, resolve_device, resolve_dtype, resolve_tokenizer)
from .llm_chat import ChatMixin
from .llm_memory import EngineMemoryMixin
from .llm_online import OnlineRequestsMixin
from .llm_requests import RequestsMixin
from .llm_setup import (engine_config, eos_token_ids, folder_config, kv_bytes_per_sequence,
                        load_folder, pick_device, runner_model)
from .llm_steps import EngineStepsMixin
from .linear_state_cache import linear_state_spec
from .outputs import RequestOutput
from .pipeline import PipelineStage, check_stage_model, join_pipeline
from .pipeline_comm import PipelineComm
from .pipeline_worker import Pipeline
from .progress import progress_bar
from .sampler import Sampler
from .sampling_params import MAX_LOGPROBS, SamplingParams

class LLM(ChatMixin, RequestsMixin, OnlineRequestsMixin, EngineStepsMixin, EngineMemoryMixin):
    """A paged-KV rollout engine over a vexact-models architecture.

    A bad argument (or a model that is not a vexact-models causal LM, e.g. a stock transformers
    one loaded without `vexact_models.patch()`) raises ValueError naming it, its value and the
    limit, before the engine changes anything.

    Args:
        model: checkpoint folder or hub model id (``Qwen/Qwen3-8B``: its configs, safetensors and
            tokenizer fetched into the hub cache first, `hub_config.checkpoint_folder`; of a published
            multimodal checkpoint its text model, `vexact_models.multimodal`), or a training-variant
            model instance (the engine then shares its parameter storage: no copy, updates are seen by
            the next step). The engine puts each q/k/v and gate/up weight group in one buffer
            (`layers.fuse_projections`): the parameters stay the same objects and values, now views, and
            rollouts run one GEMM per group; an in-place optimizer step reaches it. Replacing a
            parameter's ``.data`` afterwards (e.g. ``model.to``) just falls back to separate GEMMs.
        dtype: parameter/activation dtype when loading a folder ("auto": the checkpoint's).
        device: defaults to CUDA when available, else CPU.
        block_size: positions per KV page (default `llm_args.default_block_size`: 64 where the
            decode reads whole key blocks by TMA, a latent MLA cache and GQA caches of head dims
            64 or 128; else 16).
        max_num_seqs: sequences per step at most.
        max_num_batched_tokens: tokens per step at most (the chunked-prefill budget).
        max_model_len: prompt + output length limit (default: the model's max positions).
        gpu_memory_utilization: fraction of the GPU's memory the process may use (weights and
            everything else included); the KV cache takes what is left of it.
        kv_cache_bytes: KV cache size in bytes (required on CPU unless the default 256 MiB fits).
            A model mixing sliding-window and full attention layers (Gemma 3, GPT-OSS) keeps the
            windowed layers' pages apart, freed behind the window (`runtime.page_groups`), each
            group's page at its own layers' bytes; `kv_bytes_per_sequence` says what a sequence
            holds.
        seed: base seed for requests that give none.
        enable_chunked_prefill: split long prompts over steps.
        enforce_eager: never use CUDA graphs (by default, on CUDA, decode steps of up to
            ``max_num_seqs`` sequences replay graphs captured at construction, and steps with
            prompt chunks of up to ``cuda_graph_max_tokens`` tokens replay graphs captured on
            first use of their shape bucket; results are bitwise the same either way).
        cuda_graph_max_tokens: the most tokens of a step with prompt chunks that replays a CUDA
            graph (default: 2,048, or ``max_num_batched_tokens`` if smaller; 0: decode steps
            only). Each new bucket (`runtime.cuda_graphs`) costs a capture (about two eager
            steps of host time) and its activations stay in the graphs' memory pool, outside the
            KV budget; larger steps keep the GPU busy about as long as their eager launches take
            the host. Pipeline-parallel engines capture decode steps only.
        async_scheduling: launch the next step (decodes, and admissions into the slots free
            now) before the current one's tokens reach the host, the decodes' input tokens taken
            on the device, so that the device does not idle while the host postprocesses and
            schedules (`runtime.llm_steps`). A sequence that stops runs one step too many, whose
            result is dropped. Results are bitwise the same either way; False runs one step at a
            time. Pipeline-parallel engines run one step at a time regardless.
        enable_prefix_sharing: share the KV pages of common full-page prefixes between the
            sequences of one ``generate`` call (the n samples of a prompt, prompts with a common
            start) instead of computing them again; results are bitwise the same either way. An
            engine that owns its weights (``owns_weights``) also shares the pages earlier calls
            left, until `update_weights`, `sleep` or `wake_up` (a multi-turn conversation's next
            turn prefills only its new tokens); over a trainer's weights, which may change in
            place, each call starts afresh. Gated-DeltaNet models share a prompt among its n
            samples (`runtime.scheduler_siblings`) and the prompts ``prefix_states`` keeps.
        aligned: False runs the non-aligned fast path (cuBLAS GEMMs, torch norms; CUDA only):
            faster, but its logprobs no longer equal the training forward's. For measuring
            what alignment costs. True (the default) runs the backend the user chose
            (`vexact_models.kernels.set_backend`, ``use_backend``, ``VEXACT_BACKEND``), else
            the device's default, read at each `generate` (see `backend`).
        owns_weights: whether `sleep` may take the weights off the device (levels 1 and 2).
            Default: True for a checkpoint folder, False for a model instance (a trainer's
            weights are never released); pass True for an instance only the engine uses (e.g.
            a full copy beside an FSDP-sharded trainer).
        pipeline_parallel_size: stages of a pipeline-parallel engine, one process each (at most
            the model's decoder layers). Every rank of an initialised process group of this
            world size (e.g. under torchrun) constructs the engine with the same arguments and
            calls `generate` with the same arguments; all ranks return the same outputs. Stage
            s = rank s runs a contiguous range of decoder layers (`pipeline_stage`) and holds
            their KV pages (``kv_cache_bytes`` / ``gpu_memory_utilization`` are per process; a
            model mixing windowed and full layers keeps its window page group there too); a
            checkpoint folder loads only the stage's tensors. The logprobs equal a
            single-process rollout's bitwise. ``update_weights``, ``sleep`` and ``wake_up`` are
            called on every rank. docs/pipeline.md.
        tokenizer: for text prompts, returned text and stop strings: a transformers tokenizer, or
            a folder or hub id to load one from (``AutoTokenizer``). Default: the checkpoint
            folder's, if it has one (a model instance has none).
        cuda_graph_sizes: the decode batch sizes captured as CUDA graphs below ``max_num_seqs``
            (which is always captured; vLLM's ``cuda_graph_sizes``): a step runs the graph of the
            smallest that holds its sequences, the rest padded (the same bits, rule 1); steps
            with prompt chunks use the same sizes. Default `runtime.cuda_graphs.DEFAULT_BUCKETS`
            (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ...); fewer sizes capture faster, each a
            warm-up and a capture of a step's forward.
        max_logprobs: the most alternatives ``SamplingParams.logprobs`` and ``prompt_logprobs``
            may ask for a position (vLLM's engine argument; default 20, at most
            `llm_args.MAX_LOGPROBS_LIMIT`, 2,048: `kernels.top_tokens` keeps at most a
            2,048-column chunk's candidates from each chunk). A request asking for more is a
            ValueError before anything runs.
        prefix_states: models with gated-DeltaNet layers (Qwen3.5, Qwen3-Next): keep up to this
            many states of prompts (at their last whole page), of replies (every 64 tokens) and
            where prompts that begin alike part (a system prompt), so that a later request
            beginning with one (a conversation's next turn) takes its pages and state instead of
            prefilling it again, bitwise the same (`runtime.scheduler_prefix_states`; kept as shared
            pages are, given back before any preemption; each costs a sequence's state of the KV
            budget, 61 MiB at Qwen3.5-35B-A3B's shape). Default 0: none.

    Threads: one call runs at a time (`runtime.engine_lock`). A ``generate``, ``update_weights``,
    ``sleep`` or ``wake_up`` called while another thread's call is running waits for it to
    return, then runs as it would alone: its outputs do not change. Requests that give no seed
    take one derived from the engine's ``seed`` and their index over the engine's life, so the
    order in which waiting threads get their turn decides those seeds; give ``params.seed`` to
    make a call's outputs independent of other threads. A call made from inside a running call
    on the same thread (a callback) raises RuntimeError instead of waiting for itself. The
    kernel backend (`vexact_models.kernels.set_backend` / ``use_backend``) is a process-wide
    setting, read by every kernel: change it only while no call is running.
    """

    def __init__(self, model, *, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 block_size: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_bytes: int | None = None, seed: int = 0, enable_chunked_prefill: bool = True,
                 enforce_eager: bool = False, aligned: bool = True, async_scheduling: bool = True,
                 enable_prefix_sharing: bool = True, owns_weights: bool | None = None,
                 pipeline_parallel_size: int = 1, cuda_graph_max_tokens: int | None = None,
                 tokenizer=None, max_logprobs: int = MAX_LOGPROBS,
                 cuda_graph_sizes: Seq[int] | None = None, prefix_states: int = 0) -> None:
        self._engine_lock = EngineLock()  # held by each public call (the class docstring: Threads)
        # Every check first: fusing the projections below is the only change made to a model passed in.
        check_model_argument(model)
        given_tokenizer = resolve_tokenizer(tokenizer)
        check_engine_args(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_bytes=kv_cache_bytes, seed=seed, pipeline_parallel_size=pipeline_parallel_size,
                          cuda_graph_max_tokens=cuda_graph_max_tokens, max_logprobs=max_logprobs,
                          cuda_graph_sizes=cuda_graph_sizes, prefix_states=prefix_states,
                          flags=dict(enable_chunked_prefill=enable_chunked_prefill, enforce_eager=enforce_eager,
                                     aligned=aligned, enable_prefix_sharing=enable_prefix_sharing,
                                     async_scheduling=async_scheduling))
        load_dtype = resolve_dtype(dtype)
        from_folder = isinstance(model, (str, os.PathLike))
        if from_folder:
            model = checkpoint_folder(model, "LLM: model")  # a hub model id: fetched (or found in the hub cache) first
        target = folder_config(str(model))[1] if from_folder else architecture_of(model)
        if pipeline_parallel_size > 1:  # engine features it cannot use yet (Architecture.rollout_features_missing)
            target.check_rollout_feature("pipeline_parallel", "use pipeline_parallel_size=1")
        if not from_folder:
            check_model_placement(model, resolve_device(device), load_dtype)
        stage = join_pipeline(pipeline_parallel_size, folder_config(str(model))[0] if from_folder else model.config)
        if stage is not None and not from_folder:
            check_stage_model(model, stage)
        self.device = pick_device(model, resolve_device(device), stage)
        if self.device.type == "cuda" and not enforce_eager:
            target.check_rollout_feature("cuda_graphs", "pass enforce_eager=True")
        if not aligned and self.device.type != "cuda":
            raise ValueError(f"LLM: aligned=False (the cuBLAS fast path) needs a CUDA device, got {self.device}")
        self.aligned = aligned
        self.async_scheduling = async_scheduling
        training, self.tokenizer = load_folder(str(model), dtype, stage, self.device) if from_folder else (model, None)
        self.tokenizer = given_tokenizer if given_tokenizer is not None else self.tokenizer
        arch = architecture_of(training)
        self._init_weight_state(from_folder if owns_weights is None else owns_weights)
        self.model = arch.inference_class(training)
        linear = linear_state_spec(self.model)  # gated-DeltaNet layers: their state cache (runtime.linear_state_cache)
        self.config = training.config
        self.dtype = next(training.parameters()).dtype
        self.pipeline = None if stage is None else Pipeline(stage, PipelineComm(
            stage.index, stage.size, self.device, self.dtype, self.config.hidden_size))
        self.max_model_len = check_max_model_len(max_model_len, self.config)
        self.eos_token_ids = eos_token_ids(self.model, self.config, self.tokenizer)
        self.engine_config = engine_config(
            self.model, self.dtype, self.device, self.pipeline, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes,
            enable_chunked_prefill=enable_chunked_prefill, enable_prefix_sharing=enable_prefix_sharing,
            linear_states=linear is not None, enforce_eager=enforce_eager, cuda_graph_max_tokens=cuda_graph_max_tokens,
            cuda_graph_sizes=cuda_graph_sizes, prefix_states=prefix_states)
        self.scheduler = self.engine_config.make_scheduler()
        # one GEMM for q/k/v and for gate/up in rollouts; the training model shares the storage
        # (before the runner: its CUDA graphs capture the fused GEMMs)
        fuse_projections(training)
        self.step_times: list[tuple[int, bool, float]] | None = None  # (sequences, decode-only, seconds)
        backend = self.backend
        with use_backend(backend):  # CUDA graphs capture the engine's kernels
            model_part, layers, carry_width = runner_model(self.model, self.pipeline, self.config.hidden_size)
            self.runner = self.engine_config.make_runner(model_part, self.device, self.dtype, self.scheduler, layers=layers,
                                                         carry_width=carry_width)
        self._remember_graphs(backend)
        self.sampler = Sampler(self.engine_config.eos_token_id)
        self.seed = seed
        self.max_logprobs = max_logprobs
        self._next_request = 0
        self.num_preemptions = 0  # sequences preempted (by recompute) so far
        self._init_online()

    @property
    def block_manager(self) -> BlockManager:
        """The KV pages' bookkeeping (the scheduler's; with pipeline parallelism, the first stage's)."""
        return self.scheduler.block_manager

    def kv_bytes_per_sequence(self, num_tokens: int, window_freed: bool = True) -> int:
        """KV-cache bytes a sequence of `num_tokens` computed tokens holds in this engine (its
        dtype and page size), with the pages behind its windowed layers' windows freed or, with
        `window_freed` False, every page kept (`llm_setup.kv_bytes_per_sequence`); a pipeline
        stage's engine counts the whole model, and frees pages behind the window only in a window
        group (its stages keep every page of a model whose every layer is windowed)."""
        freed = self.pipeline is None or self.engine_config.window_group is not None
        return kv_bytes_per_sequence(self.model, num_tokens, dtype=self.dtype, block_size=self.engine_config.block_size,
                                     window_freed=window_freed and freed)

    @property
    def pipeline_stage(self) -> PipelineStage | None:
        """This process's pipeline stage (its index, the stage count, its decoder layers), or
        None without pipeline parallelism."""
        return None if self.pipeline is None else self.pipeline.stage

    # -- construction helpers -------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The kernel backend the engine runs now: ``"fast"`` when built with ``aligned=False``,
        else the user's choice (`vexact_models.kernels.set_backend` / ``use_backend`` /
        ``VEXACT_BACKEND``) or the device's default, read at each `generate` as the training
        forward reads it, so that both sides run the same kernels."""
        return "fast" if not self.aligned else current_backend(self.device)

    def _remember_graphs(self, backend: str) -> None:
        """Note which backend and attention forward (`vexact_models.kernels.use_attention_forward`)
        the runner's CUDA graphs (if any) were captured under."""
        graphs = self.runner.graphs
        self._graphs_key = (None if graphs is None else weakref.ref(graphs), self._computed_under(backend))

    def _computed_under(self, backend: str) -> tuple:
        """What the engine's kernels compute with, which CUDA graphs replay and KV pages hold the
        results of: the backend, the attention forward, the PEFT adapters' state
        (`adapters.adapter_state`: enabled, merged, active, their weights' storage) and whether the
        adapted experts read B's kept copies (``VEXACT_EXPERT_B``, `ModelRunner.kept_b`)."""
        return backend, attention_forward_mode(), adapter_state(self.model), EXPERT_B.mode()

    def _graphs_follow(self, backend: str) -> None:
        """CUDA graphs replay the kernels they captured: when what they computed with
        (`_computed_under`) or the graphs (e.g. recaptured by `wake_up`) changed since they were
        noted, capture them again under `backend`, after fusing the projection groups and their
        adapters again (an adapter added or a weight replaced since). The KV cache is reallocated
        with them, and nothing published before is shared again. Else what the forwards read
        derived from the weights is refreshed (`ModelRunner.refresh_derived`)."""
        graphs = self.runner.graphs
        ref, captured = self._graphs_key
        if graphs is None or (ref is not None and ref() is graphs and captured == self._computed_under(backend)):
            return self.runner.refresh_derived()
        fuse_projections(self.model)
        self.runner.free_cache()
        with use_backend(backend):
            self.runner.allocate_cache()
        self.scheduler.reset_prefix_cache()  # a new cache holds none of the published pages or kept states
        self._remember_graphs(backend)

    def _keep_prefix_cache(self, backend: str) -> bool:
        """Whether the pages published by earlier calls may be shared by this one: only in an
        engine that owns its weights (no trainer writes them in place unseen; not a pipeline
        stage), when nothing that writes the weights or the cache (`update_weights`, `sleep`,
        `wake_up`: ``_cache_epoch``), nor the backend, the attention forward or the adapters'
        state changed since the last call."""
        key = None
        if self.owns_weights and self.pipeline is None:
            key = (self._cache_epoch, self._computed_under(backend))
        keep = key is not None and key == self._prefix_key
        self._prefix_key = key
        return keep

    # -- requests -------------------------------------------------------------------------
    @one_call_at_a_time
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts` (token-id lists, or strings with a tokenizer; or, as
        vLLM takes them, ``{"prompt_token_ids": ids}`` and ``{"prompt": text}`` dicts).

        `sampling_params` is one `SamplingParams` for all prompts or one per prompt. A request's
        tokens depend only on its prompt, its parameters and its seed (``params.seed``, or one
        derived from the engine's ``seed`` and the request's index when None); with ``n > 1``,
        sample i uses a seed derived from (seed, i), so sample 0 of an n=4 request differs from
        the n=1 completion with the same seed. Returns one
        `RequestOutput` per prompt, in order, each with ``params.n`` completions carrying token
        ids, per-token logprobs and the finish reason. Bad input raises ValueError before any
        work starts. Logits holding a NaN or an infinity (e.g. a NaN weight) raise RuntimeError
        naming the requests; as after any failed or interrupted call, the call's requests are
        dropped, their KV pages freed, and the engine serves the next call. While another
        thread's call runs, this one waits for it (the class docstring: Threads).
        """
        if hasattr(prompts, "tolist") and not isinstance(prompts, list):  # a tensor or numpy array of ids
            prompts = prompts.tolist()
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"LLM.generate: {len(params)} sampling_params for {len(prompts)} prompts")
        self._check_no_online("LLM.generate")
        token_ids = [self._token_ids(p, sp) for p, sp in zip(prompts, params)]  # validate all before scheduling
        self._check_params(params)
        grammars, bad_words = self._compile_grammars(params), self._bad_words(params)
        self._check_awake("LLM.generate")
        if self.pipeline is not None and not self.pipeline.stage.is_first:
            return self._serve_stage(len(prompts))
        # Shared pages outlive a call only where their K/V cannot be stale (`_keep_prefix_cache`):
        # weights shared with a trainer may change in place between calls, update_weights writes
        # new ones, sleep()/wake_up() hands back an uninitialised cache.
        if not self._keep_prefix_cache(self.backend):
            self.scheduler.reset_prefix_cache()
        self._scores_prompts = any(p.prompt_logprobs is not None for p in params)  # (llm_steps)
        self.sampler.begin_call(any(p.uses_penalties for p in params))
        requests = []
        try:
            for ids, p, grammar, bad in zip(token_ids, params, grammars, bad_words):
                seqs = self._make_sequences(self._next_request, ids, p, grammar, bad)
                self._next_request += 1
                requests.append(seqs)
                for seq in seqs:
                    self.scheduler.add(seq)
            self._run(sum(len(r) for r in requests), use_tqdm)
        except BaseException:
            self._abort()  # drop this call's requests so that the engine stays usable
            if self.pipeline is not None:
                self.pipeline.abort()
            raise
        outputs = [self._output(prompt, ids, seqs) for prompt, ids, seqs in zip(prompts, token_ids, requests)]
        return outputs if self.pipeline is None else self.pipeline.finish(outputs)

    def _serve_stage(self, num_requests: int) -> list[RequestOutput]:
        """``generate`` on a pipeline stage after the first: run the first stage's steps
        through this stage's layers; return the outputs the first stage shares at the end."""
        self._next_request += num_requests  # request ids as on the first stage
        backend = self.backend
        with use_backend(backend):
            self._graphs_follow(backend)
            self.pipeline.serve(self)
        return self.pipeline.finish()

    def _abort(self) -> None:
        """Forget every queued or running request (after a failed step or an interrupt): fresh
        scheduler and page bookkeeping, same settings. Only the failed call's requests can be in
        flight, since generate() runs its requests to completion."""
        self.scheduler = self.engine_config.make_scheduler()
        self.engine_config.connect(self.runner, self.scheduler)
        self._launched = None

    def _run(self, total: int, use_tqdm: bool) -> None:
        backend = self.backend  # the user's choice now (set_backend / use_backend / VEXACT_BACKEND)
        with use_backend(backend):
            self._graphs_follow(backend)
            bar = progress_bar(total, use_tqdm)
            self._loop(bar)
