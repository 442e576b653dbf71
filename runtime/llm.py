"""LLM: the rollout engine's front end, in the style of vLLM's ``LLM``.

    llm = LLM("path/to/checkpoint")                 # or LLM(training_model) to share weights
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=256, seed=0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs

Each step: `Scheduler.schedule` -> `ModelRunner.execute` -> `Sampler` -> `Scheduler.postprocess`.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Iterable, Sequence as Seq

import torch
from tqdm.auto import tqdm

from vexact_models.kernels import use_backend

from .block_manager import BlockManager
from .model_runner import ModelRunner, kv_bytes_per_block
from .outputs import CompletionOutput, RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads derived seeds


def _derive_seed(base: int, index: int) -> int:
    return (base * 1_000_003 + (index + 1) * _SEED_STRIDE) % (1 << 63)


class LLM:
    """A paged-KV rollout engine over a vexact-models architecture.

    Args:
        model: checkpoint folder, or a training-variant model instance (the engine then shares
            its parameter storage: no copy, updates are seen by the next step). The engine puts
            each q/k/v and gate/up weight group in one buffer (`layers.fuse_projections`): the
            parameters stay the same objects and values, now views, and rollouts run one GEMM
            per group; an in-place optimizer step reaches it. Replacing a parameter's ``.data``
            afterwards (e.g. ``model.to``) just falls back to separate GEMMs.
        dtype: parameter/activation dtype when loading a folder ("auto": the checkpoint's).
        device: defaults to CUDA when available, else CPU.
        block_size: positions per KV page.
        max_num_seqs: sequences per step at most.
        max_num_batched_tokens: tokens per step at most (the chunked-prefill budget).
        max_model_len: prompt + output length limit (default: the model's max positions).
        gpu_memory_utilization: fraction of the GPU's memory the process may use (weights and
            everything else included); the KV cache takes what is left of it.
        kv_cache_bytes: KV cache size in bytes (required on CPU unless the default 256 MiB fits).
        seed: base seed for requests that give none.
        enable_chunked_prefill: split long prompts over steps.
        enforce_eager: never use CUDA graphs (by default decode steps of up to ``max_num_seqs``
            sequences replay captured graphs on CUDA; results are bitwise the same either way).
        enable_prefix_sharing: share the KV pages of common full-page prefixes between the
            sequences of one ``generate`` call (the n samples of a prompt, prompts with a common
            start) instead of computing them again; results are bitwise the same either way.
        aligned: False runs the non-aligned fast path (cuBLAS GEMMs, torch norms; CUDA only):
            faster, but its logprobs no longer equal the training forward's. For measuring
            what alignment costs.
    """

    def __init__(self, model, *, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_bytes: int | None = None, seed: int = 0, enable_chunked_prefill: bool = True,
                 enforce_eager: bool = False, aligned: bool = True,
                 enable_prefix_sharing: bool = True) -> None:
        from vexact_models.layers import fuse_projections
        from vexact_models.registry import for_model_type

        if device is not None:
            self.device = torch.device(device)
        elif isinstance(model, torch.nn.Module):  # a model instance: run where it lives
            self.device = next(model.parameters()).device
        else:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = None
        self._generation_config = None  # generation_config.json of a checkpoint folder
        if isinstance(model, (str, os.PathLike)):
            training = self._load(str(model), dtype)
        else:
            training = model
        arch = for_model_type(training.config.model_type)
        if arch is None:
            raise ValueError(f"LLM: model_type {training.config.model_type!r} is not supported")
        self.model = arch.inference_class(training)
        # one GEMM for q/k/v and for gate/up in rollouts; the training model shares the storage
        fuse_projections(training)
        self.config = training.config
        self.dtype = next(training.parameters()).dtype
        self.max_model_len = self._check_len(max_model_len)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"LLM: gpu_memory_utilization={gpu_memory_utilization} is outside (0, 1]")
        num_blocks = self._num_blocks(block_size, gpu_memory_utilization, kv_cache_bytes)
        self.eos_token_ids = self._eos_ids()
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_sharing=enable_prefix_sharing)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, self.max_model_len,
                                   eos, chunked_prefill=enable_chunked_prefill)
        if not aligned and self.device.type != "cuda":
            raise ValueError("LLM: aligned=False (the cuBLAS fast path) needs a CUDA device")
        self.backend = None if aligned else "fast"
        self.step_times: list[tuple[int, bool, float]] | None = None  # (sequences, decode-only, seconds)
        with use_backend(self.backend):  # CUDA graphs capture the chosen kernels
            self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, self.dtype,
                                      cuda_graph_batch=0 if enforce_eager else max_num_seqs,
                                      max_model_len=self.max_model_len)
        self.runner.block_tables = self.block_manager.tables
        self.sampler = Sampler(eos)
        self.seed = seed
        self._next_request = 0
        self.num_preemptions = 0  # sequences preempted (by recompute) so far

    # -- construction helpers -------------------------------------------------------------
    def _load(self, path: str, dtype):
        from transformers import AutoConfig

        from vexact_models.registry import for_model_type

        config = AutoConfig.from_pretrained(path)
        arch = for_model_type(config.model_type)
        if arch is None:
            raise ValueError(f"LLM: {path} has model_type {config.model_type!r}, which vexact-models does not support")
        if dtype == "auto":
            torch_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        else:
            torch_dtype = dtype
        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
        model = arch.causal_lm_class.from_pretrained(path, dtype=torch_dtype).to(self.device).eval()
        if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(path)
        if os.path.exists(os.path.join(path, "generation_config.json")):
            # our training classes do not load it (they are not GenerationMixins), yet it holds the
            # checkpoint's EOS list (Qwen3: <|im_end|> and <|endoftext|>)
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_pretrained(path)
        return model

    def _check_len(self, max_model_len: int | None) -> int:
        limit = int(self.config.max_position_embeddings)
        if max_model_len is None:
            return limit
        if not 1 <= max_model_len <= limit:
            raise ValueError(f"LLM: max_model_len={max_model_len} is outside [1, max_position_embeddings={limit}]")
        return int(max_model_len)

    def _num_blocks(self, block_size: int, utilization: float, kv_cache_bytes: int | None) -> int:
        per_block = kv_bytes_per_block(self.model.kv_cache_spec(), block_size, self.dtype)
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free - (1 - utilization) * total)
            else:
                kv_cache_bytes = 256 << 20
        blocks = kv_cache_bytes // per_block
        if blocks < 1:
            raise ValueError(f"LLM: the KV cache budget ({kv_cache_bytes} bytes) is smaller than one block "
                             f"({per_block} bytes); raise kv_cache_bytes or gpu_memory_utilization")
        return int(blocks)

    def _eos_ids(self) -> list[int]:
        gen = getattr(self.model.causal_lm, "generation_config", None) or self._generation_config
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    # -- requests -------------------------------------------------------------------------
    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("LLM.generate: text prompts need a tokenizer in the checkpoint folder; pass token ids")
            # tokenized text gets the same checks as token ids (empty, out of vocabulary, too long)
            prompt = self.tokenizer(prompt)["input_ids"]
        try:  # operator.index: ints (and integer tensors/numpy ints) only, never 3.7 -> 3 or True
            ids = [operator.index(t) if not isinstance(t, bool) else None for t in prompt]
        except TypeError:
            ids = [None]
        if None in ids:
            raise ValueError("LLM.generate: prompt token ids must be integers")
        vocab = self.config.vocab_size
        if not ids:
            raise ValueError("LLM.generate: prompt is empty (it needs at least one token)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"LLM.generate: prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"LLM.generate: prompt length {len(ids)} must be below max_model_len={self.max_model_len}")
        return ids

    def _make_sequences(self, request_id: int, ids: list[int], params: SamplingParams) -> list[Sequence]:
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:
            from dataclasses import replace

            params = replace(params, stop_token_ids=list(params.stop_token_ids) + extra_eos)
        base = params.seed if params.seed is not None else _derive_seed(self.seed, request_id)
        return [Sequence(request_id, i, ids, params, base if params.n == 1 else _derive_seed(base, i))
                for i in range(params.n)]

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts` (token-id lists, or strings with a tokenizer).

        `sampling_params` is one `SamplingParams` for all prompts or one per prompt. A request's
        tokens depend only on its prompt, its parameters and its seed (``params.seed``, or one
        derived from the engine's ``seed`` and the request's index when None); with ``n > 1``,
        sample i uses a seed derived from (seed, i), so sample 0 of an n=4 request differs from
        the n=1 completion with the same seed. Returns one
        `RequestOutput` per prompt, in order, each with ``params.n`` completions carrying token
        ids, per-token logprobs and the finish reason. Bad input raises ValueError before any
        work starts.
        """
        if hasattr(prompts, "tolist") and not isinstance(prompts, list):  # a tensor or numpy array of ids
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"LLM.generate: {len(params)} sampling_params for {len(prompts)} prompts")
        token_ids = [self._token_ids(p) for p in prompts]  # validate everything before scheduling
        if not self.runner.kv_caches:
            raise RuntimeError("LLM.generate: the engine is asleep (sleep() released the KV cache); "
                               "call wake_up() first")
        # Shared pages live within one call: between calls the weights may have changed
        # (update_weights, or in place through storage shared with a training model) and
        # sleep()/wake_up() hands back an uninitialised cache, so cached K/V may be stale.
        self.block_manager.reset_prefix_cache()
        requests = []
        try:
            for ids, p in zip(token_ids, params):
                seqs = self._make_sequences(self._next_request, ids, p)
                self._next_request += 1
                requests.append(seqs)
                for seq in seqs:
                    self.scheduler.add(seq)
            self._run(sum(len(r) for r in requests), use_tqdm)
        except BaseException:
            self._abort()  # drop this call's requests so that the engine stays usable
            raise
        return [self._output(prompt, ids, seqs) for prompt, ids, seqs in zip(prompts, token_ids, requests)]

    def _abort(self) -> None:
        """Forget every queued or running request (after a failed step or an interrupt): fresh
        scheduler and page bookkeeping, same settings. Only the failed call's requests can be in
        flight, since generate() runs its requests to completion."""
        s = self.scheduler
        bm = self.block_manager
        self.block_manager = BlockManager(bm.num_blocks, bm.block_size, enable_prefix_sharing=bm.enable_prefix_sharing)
        self.scheduler = Scheduler(self.block_manager, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len,
                                   s.eos_token_id, chunked_prefill=s.chunked_prefill)
        self.runner.block_tables = self.block_manager.tables

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, desc="generate", unit="seq", disable=not use_tqdm)
        with use_backend(self.backend):
            self._loop(bar)

    def _loop(self, bar) -> None:
        try:
            while self.scheduler.has_unfinished():
                started = time.perf_counter()
                step = self.scheduler.schedule()
                self.num_preemptions += len(step.preempted)
                bar.update(len(step.errored))
                if not step.scheduled:
                    continue
                logits = self.runner.execute(step.scheduled)
                sampling = [item.seq for item in step.scheduled if item.samples]
                tokens, logprobs = self.sampler(logits, sampling)
                if len(sampling) < len(step.scheduled):  # None for the non-final prefill chunks
                    it_t, it_l = iter(tokens), iter(logprobs)
                    tokens = [next(it_t) if item.samples else None for item in step.scheduled]
                    logprobs = [next(it_l) if item.samples else None for item in step.scheduled]
                bar.update(len(self.scheduler.postprocess(step.scheduled, tokens, logprobs)))
                if self.step_times is not None:  # the sampler's host sync ended the step
                    decode = all(item.num_new_tokens == 1 for item in step.scheduled)
                    self.step_times.append((len(step.scheduled), decode, time.perf_counter() - started))
        finally:
            bar.close()

    def _output(self, prompt, ids: list[int], seqs: list[Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            text = (self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                    if self.tokenizer is not None else None)
            completions.append(CompletionOutput(seq.sample_index, list(seq.output_token_ids),
                                                list(seq.output_logprobs), seq.finish_reason, text, seq.error))
        return RequestOutput(seqs[0].request_id, prompt if isinstance(prompt, str) else None, ids, completions)

    # -- weights and memory ---------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors (HF checkpoint names) into the engine's parameters, in place.

        Unknown names or wrong shapes raise ValueError before anything is written.
        """
        # remove_duplicate=False: tied weights answer to every name (a tied model's state_dict()
        # lists lm_head.weight, which named_parameters() would drop as a duplicate)
        params = dict(self.model.causal_lm.named_parameters(remove_duplicate=False))
        items = list(weights.items() if isinstance(weights, dict) else weights)
        for name, tensor in items:
            if name not in params:
                raise ValueError(f"LLM.update_weights: unknown parameter {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"LLM.update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
        for name, tensor in items:
            params[name].copy_(tensor)

    def sleep(self) -> None:
        """Release the KV cache memory (e.g. while the trainer runs); `wake_up` restores it.

        Weights are kept. Until `wake_up`, `generate` raises RuntimeError (queuing nothing)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("LLM.sleep: requests are still running")
        self.runner.free_cache()

    def wake_up(self) -> None:
        """Re-allocate the KV cache released by `sleep`."""
        if not self.runner.kv_caches:
            self.runner.allocate_cache()
