"""The engine's settings in one object, and the one place that wires its parts from them.

`LLM` resolves its arguments (and the model's limits and memory) into an `EngineConfig`;
`EngineConfig.make_scheduler` builds a `BlockManager` and the `Scheduler` over it (again after a
failed step: `LLM._abort`), `EngineConfig.make_runner` the `ModelRunner` that reads that
BlockManager's block tables. Benchmarks and the pipeline-parallel engine wire the same parts
the same way through these two calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .cuda_graphs import DEFAULT_BUCKETS
from .model_runner import ModelRunner
from .page_groups import PageGroups, WindowGroup
from .scheduler import Scheduler

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-cache settings of one engine (the resolved `LLM` arguments).

    Attributes:
        num_blocks: KV pages in the cache (the same page ids on every pipeline stage).
        block_size: positions per page.
        max_num_seqs: sequences per step at most.
        max_num_batched_tokens: tokens per step at most (the chunked-prefill budget).
        max_model_len: prompt + output tokens of one sequence at most.
        eos_token_id: the EOS id that ends sequences in the scheduler (None: none).
        enable_chunked_prefill: split long prompts over steps.
        enable_prefix_sharing: share the KV pages of common full-page prefixes.
        share_prompt_state: the n samples of a request prefill their prompt once, the others
            taking its pages and a copy of its gated-DeltaNet state (`runtime.scheduler_siblings`;
            for models with such layers, with ``enable_prefix_sharing`` off).
        prefix_states: gated-DeltaNet states of prompts kept for later requests that begin with
            them (`runtime.scheduler_prefix_states`; 0: none; with ``enable_prefix_sharing`` off).
        cuda_graph_batch: decode steps of up to this many sequences replay CUDA graphs
            (0: always eager, ``enforce_eager``; ignored off CUDA).
        cuda_graph_sizes: the decode batch sizes below ``cuda_graph_batch`` captured besides it
            (a step is padded to the smallest that holds it; `runtime.cuda_graphs.DEFAULT_BUCKETS`
            by default).
        cuda_graph_tokens: steps with prompt chunks of up to this many tokens (and
            ``cuda_graph_batch`` sequences) replay CUDA graphs too, captured on first use
            (0: decode steps only; pipeline stages capture decode steps only).
        kv_window: None, or the sliding window every attention layer stays within
            (`layers.cache_window`): the pages behind it are freed as sequences advance
            (`LLM` leaves it None for pipeline stages).
        window_group: None, or the window page group of a model mixing windowed and full
            attention layers (`runtime.page_groups`: those layers' K/V in pages of their own, freed
            behind the window; the same on every pipeline stage, each holding its own windowed
            layers' pages there).
        kept_b_limit: the bytes the budget set aside for the adapted experts' B copied by expert
            (`llm_setup.kept_b_budget`; None: no limit), which the runner's copies stay within.
    """

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_id: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_sharing: bool = True
    share_prompt_state: bool = False
    prefix_states: int = 0
    cuda_graph_batch: int = 0
    cuda_graph_tokens: int = 0
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_BUCKETS
    kv_window: int | None = None
    window_group: WindowGroup | None = None
    kept_b_limit: int | None = None

    def make_scheduler(self) -> Scheduler:
        """A fresh `BlockManager` (`PageGroups` with a window group; every page free, no shared
        prefix) and the `Scheduler` over it."""
        group = self.window_group
        if group is not None:
            block_manager = PageGroups(self.num_blocks, self.block_size, group.num_blocks, group.window,
                                       enable_prefix_sharing=self.enable_prefix_sharing)
        else:
            block_manager = BlockManager(self.num_blocks, self.block_size,
                                         enable_prefix_sharing=self.enable_prefix_sharing, window=self.kv_window)
        return Scheduler(block_manager, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                         self.eos_token_id, chunked_prefill=self.enable_chunked_prefill,
                         share_prompt_state=self.share_prompt_state, prefix_states=self.prefix_states)

    def make_runner(self, model, device: torch.device, dtype: torch.dtype, scheduler: Scheduler | None = None,
                    layers: range | None = None, carry_width: int = 0) -> ModelRunner:
        """The `ModelRunner` of `model` with this cache geometry (its KV cache allocated, and its
        CUDA graphs captured when ``cuda_graph_batch`` > 0 on CUDA: call it under the
        kernel backend the graphs should capture). A pipeline stage passes its decoder `layers`
        (whose KV pages it holds; default all) and, past the first stage, the `carry_width` of
        the hidden rows it takes from the previous stage. Connected to `scheduler` when given."""
        runner = ModelRunner(model, self.num_blocks, self.block_size, device, dtype,
                             cuda_graph_batch=self.cuda_graph_batch, max_model_len=self.max_model_len, layers=layers,
                             carry_width=carry_width, cuda_graph_tokens=self.cuda_graph_tokens,
                             state_slots=self.max_num_seqs, state_snapshots=self.prefix_states,
                             window_group=self.window_group,
                             cuda_graph_sizes=self.cuda_graph_sizes, kept_b_limit=self.kept_b_limit)
        if scheduler is not None:
            self.connect(runner, scheduler)
        return runner

    @staticmethod
    def connect(runner: ModelRunner, scheduler: Scheduler) -> None:
        """Let `runner` read the step's block tables from `scheduler`'s BlockManager mirror (one
        vectorised gather per step instead of per-sequence lists), the window group's too."""
        block_manager = scheduler.block_manager
        runner.block_tables = block_manager.tables
        runner.window_tables = block_manager.window_group.tables if isinstance(block_manager, PageGroups) else None
