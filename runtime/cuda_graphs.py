"""CUDA graphs of whole engine steps at bucketed shapes: decode steps, and steps with prompt
chunks beside the decodes ("mixed" steps).

A graph is captured per bucket ``(tokens, seqs, max_q)``: flat tokens, sequences, and the most
query tokens of one sequence (which sizes the attention grid). A step fills the first rows of
static input buffers (`runtime.graph_inputs`, with harmless padding) and replays the graph of
the smallest bucket that holds it. The graph replays exactly the kernels (and tile configs,
chosen from the bucket's sizes) the eager path would launch at that bucket, and every kernel is
row-invariant, with the same bits for every tile config (docs/design.md rules 1 and 2), so the
real rows' logits are bitwise those of the eager step: graphs on or off cannot change a logprob
(conformance checks it).

- Decode steps (every sequence adds one token and samples; bucket ``(b, b, 1)``) are captured
  for every batch bucket up to ``max_batch`` at construction. Each keeps its own logits output.
- Mixed steps of up to ``max_tokens`` tokens are captured on first use of their bucket (at most
  `MAX_MIXED_GRAPHS`; later buckets run eagerly), after one eager warm-up run of the step itself
  on the static buffers (which compiles any new kernel specialisation; its K/V writes are
  repeated by the replay with the same bits). They copy their logits into one shared buffer, so
  their outputs cost no memory per bucket; all graphs share one memory pool, which is safe
  because steps replay one at a time, in stream order, and each step's logits are consumed
  (sampled) before the next replay.

Without graphs an eager step costs the host ~25 ms at Qwen3-0.6B (hundreds of Triton launches):
~6x a decode step's GPU time (`benchmarks/throughput.py --engines aligned,aligned-eager --step-breakdown`,
H200, 2026-11-24).

A model with gated-DeltaNet layers (`runtime.linear_state_cache`) replays their steps too: the
step's plan over the state cache is staged in fixed buffers beside the attention metadata, and
every launch's grid follows the bucket (`kernels.gated_delta_step`). Unlike a K/V write, a GDN
step advances state in place (conv states, delta-rule states), so a mixed bucket's eager warm-up
runs the plan's dry run (`LinearStepBuffers.dry_run`: the same launches, reading the step's
inputs, writing only the pool's padding state); the replay then advances each state once.

A pipeline stage after the first (`runtime.pipeline`) takes the previous stage's ``(hidden,
residual)`` instead of token ids: its decode graphs read them from two more static buffers
(rows past the batch keep earlier finite values, as harmless as the dummies), and a stage
before the last returns its own ``(hidden, residual)`` rows instead of logits. Pipeline stages
capture decode steps only (``max_tokens`` 0).
"""

from __future__ import annotations

import time

import torch

from vexact_models.kernels import PagedLayout, linear_quack
from vexact_models.layers import PagedContext

from .graph_inputs import GraphInputs
from .linear_state_cache import LinearStateCache, LinearStep
from .page_groups import WindowGroup
from .step_inputs import StepInputs

__all__ = ["DEFAULT_BUCKETS", "DEFAULT_MAX_TOKENS", "MAX_MIXED_GRAPHS", "StepGraphs", "step_bucket", "token_bucket"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
#: mixed-step buckets captured at most (each costs a capture, ~2 eager steps of host time)
MAX_MIXED_GRAPHS = 48
#: the engine's default token cap for mixed steps: larger steps keep the GPU busy for about as
#: long as their eager launches take the host, so a graph costs a capture and gains little (on the
#: H200, 8,192-token prompt steps gained nothing in steady state, and their captures cost a first
#: generate 0.7-1.9 s; `benchmarks/throughput.py`, 2026-11-24)
DEFAULT_MAX_TOKENS = 2048


def token_bucket(tokens: int, cap: int) -> int:
    """The token count a step of `tokens` (<= `cap`) pads to: the smallest `DEFAULT_BUCKETS`
    entry that holds it, past 512 the next quarter of its power of two (640, 768, 896, 1024,
    1280, ...: at most 25% padding), and never more than `cap`."""
    if not 0 < tokens <= cap:
        raise ValueError(f"token_bucket: tokens={tokens} must be in [1, cap={cap}]")
    for b in DEFAULT_BUCKETS:
        if b >= tokens:
            return min(b, cap)
    half = 1 << ((tokens - 1).bit_length() - 1)  # the power of two below tokens
    quarter = half // 4
    return min(half + -(-(tokens - half) // quarter) * quarter, cap)


def step_bucket(inputs: StepInputs, batch_buckets: list[int], max_tokens: int) -> tuple[int, int, int] | None:
    """The bucket ``(tokens, seqs, max_q)`` of a step: ``(b, b, 1)`` for a decode step of up
    to b sequences (the smallest of the ascending `batch_buckets` that holds it); for a mixed
    step of up to `max_tokens` tokens, `token_bucket`'s tokens, the batch bucket of its sequences
    and its longest query chunk rounded up to a power of two (at most the tokens); None (an
    eager step) for more sequences than the largest batch bucket, or a mixed step past
    `max_tokens` (0: mixed steps are never captured)."""
    n = len(inputs.seq_lens)
    seqs = next((b for b in batch_buckets if b >= n), None)
    if seqs is None:
        return None
    if inputs.decode_only:
        return seqs, seqs, 1
    tokens = len(inputs.ids)
    if tokens > max_tokens:
        return None
    padded = max(token_bucket(tokens, max_tokens), seqs)
    return padded, seqs, min(1 << (inputs.max_seqlen_q - 1).bit_length(), padded)


class StepGraphs:
    """Captured steps: decode steps for the batch sizes `buckets` (up to ``max_batch``), and
    mixed steps of up to `max_tokens` tokens on first use (the module docstring)."""

    def __init__(self, model, kv_caches, block_size: int, max_blocks_per_seq: int, max_batch: int,
                 device: torch.device, buckets=DEFAULT_BUCKETS, carry: tuple[int, torch.dtype | None] = (0, None),
                 max_tokens: int = 0, linear_states: LinearStateCache | None = None,
                 window_group: WindowGroup | None = None) -> None:
        """`carry`: ``(width, dtype)`` of the previous pipeline stage's hidden and residual rows
        that `model` takes after the token inputs (width 0: it takes none). `max_tokens`: mixed
        steps of up to that many tokens are captured (0: decode steps only; a pipeline stage
        must pass 0). `linear_states`: the model's gated-DeltaNet state cache (None without
        such layers). `window_group`: the window page group whose layers read its own block tables
        (`runtime.page_groups`; None: one group), two more static inputs."""
        width, dtype = carry
        if width and max_tokens:
            raise ValueError(f"StepGraphs: mixed steps (max_tokens={max_tokens}) are not captured for a pipeline "
                             f"stage (carry width {width}); pass max_tokens=0")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        self.max_tokens = max(max_tokens, max_batch) if max_tokens else 0
        self.device = device
        self.linear_states = linear_states
        self.window_group = window_group
        self.inputs = GraphInputs(max_batch, max_batch, max_blocks_per_seq, device, linear_states,
                                  window=window_group is not None)
        self.mixed_inputs: GraphInputs | None = None  # made at the first mixed capture
        self.mixed_logits: torch.Tensor | None = None  # the mixed graphs' shared output
        self.carry = (None if not width else
                      tuple(torch.zeros(max_batch, width, dtype=dtype, device=device) for _ in range(2)))
        #: bucket -> (graph, its input buffers, its output)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, GraphInputs, object]] = {}
        self.num_mixed = 0  # mixed buckets captured
        self.mixed_replays = 0  # steps replayed by them
        self.mixed_capture_seconds = 0.0  # host time their warm-ups and captures took
        self.eager_steps = 0  # steps no graph holds (past the largest bucket, or a new mixed one past the cap)
        self._pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            self._capture((b, b, 1), self.inputs, carry=self.carry is not None)

    def _args(self, bucket: tuple[int, int, int], x: GraphInputs, carry: bool) -> tuple:
        tokens, seqs, max_q = bucket
        layout = PagedLayout(x.cu_seqlens[:seqs + 1], x.seq_lens[:seqs], x.block_table[:seqs], self.block_size, max_q,
                             x.seq_order[:seqs])
        linear = None if x.linear is None else LinearStep.from_arrays(
            self.linear_states, x.linear.views(tokens, seqs), layout.cu_seqlens_q, max_q)
        window = (None if self.window_group is None else
                  self.window_group.step_pages(layout, x.window_block_table[:seqs], x.window_slots[:tokens]))
        args = (x.ids[:tokens], x.positions[:tokens],
                PagedContext(layout, x.slots[:tokens], self.kv_caches, linear, window), x.logits_rows[:seqs])
        return args + tuple(t[:tokens] for t in self.carry) if carry else args

    def _capture(self, bucket: tuple[int, int, int], x: GraphInputs, carry: bool = False, shared_out: bool = False):
        """Warm up (compiles the kernels outside the capture: quack's too, `as_in_capture`; a
        gated-DeltaNet plan's dry run, the module docstring), then capture `bucket` on `x`'s
        buffers; with `shared_out` the graph copies its logits into ``mixed_logits``."""
        args = self._args(bucket, x, carry)
        if x.linear is not None:
            x.linear.dry_run()
        with linear_quack.as_in_capture():
            out = self.model(*args)
        if x.linear is not None:
            x.linear.restage()
        if shared_out and self.mixed_logits is None:
            self.mixed_logits = torch.empty(self.max_batch, out.shape[1], dtype=out.dtype, device=self.device)
        del out
        graph, out = self._record(args, bucket[1], shared_out)
        self.graphs[bucket] = (graph, x, out)

    def _record(self, args: tuple, seqs: int, shared_out: bool):
        """``(graph, its output)``: the model on `args` captured (in the shared memory pool)."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(*args)
            if shared_out:
                self.mixed_logits[:seqs].copy_(out)
        if shared_out:
            del out  # its memory goes back to the pool, for the next capture
            out = self.mixed_logits
        self._pool = graph.pool()
        return graph, out

    def release(self) -> None:
        """Free the graphs and their memory pool (the outputs live in it: dropped first). The
        caller empties the allocator's cache to hand the pool back to the device."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.mixed_logits = None
        self.num_mixed = 0
        self._pool = None

    def step_bucket(self, inputs: StepInputs) -> tuple[int, int, int] | None:
        """The bucket whose graph runs this step (`step_bucket`), or None when it runs eagerly,
        also for a new mixed bucket past `MAX_MIXED_GRAPHS`."""
        bucket = step_bucket(inputs, self.buckets, self.max_tokens)
        if bucket is not None and (bucket in self.graphs or self.num_mixed < MAX_MIXED_GRAPHS):
            return bucket
        self.eager_steps += 1
        return None

    def run(self, inputs: StepInputs, bucket: tuple[int, int, int], carry: tuple[torch.Tensor, torch.Tensor] | None = None,
            in_flight: torch.Tensor | None = None):
        """Replay the step in `bucket` (`step_bucket`'s; captured now if new): fp32 logits of the
        sampling rows ``[R, vocab]`` (a pipeline stage before the last: its ``(hidden,
        residual)`` rows). `carry`: the previous stage's ``(hidden, residual)`` rows when the
        graphs take them; `in_flight`: device token ids in place of the first
        ``len(in_flight)`` of ``inputs.ids`` (copied after the host inputs, in stream order)."""
        entry = self.graphs.get(bucket)
        if entry is not None:
            x = entry[1]
        else:  # a new mixed bucket
            if self.mixed_inputs is None:
                self.mixed_inputs = GraphInputs(self.max_tokens, self.max_batch, self.max_blocks, self.device,
                                                self.linear_states, window=self.window_group is not None)
            x = self.mixed_inputs
        x.fill(inputs, bucket[0], bucket[1])
        if in_flight is not None:
            x.ids[:len(in_flight)].copy_(in_flight)
        if self.carry is not None:
            for static, rows in zip(self.carry, carry):
                static[:len(inputs.ids)].copy_(rows)
        if entry is None:
            start = time.perf_counter()
            self._capture(bucket, x, shared_out=True)
            self.mixed_capture_seconds += time.perf_counter() - start
            self.num_mixed += 1
            entry = self.graphs[bucket]
        graph, _, out = entry
        graph.replay()
        self.mixed_replays += x is self.mixed_inputs
        if isinstance(out, tuple):
            return tuple(t[:len(inputs.ids)] for t in out)
        return out[:len(inputs.logits_rows)]
