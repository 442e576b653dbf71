"""Host (CPU) time per decode step of the paged-KV runtime, phase by phase, with no GPU work.

The runtime's real pieces (Scheduler, BlockManager, ModelRunner, Sampler) drive a stub model
whose forward returns zero logits at once, so what is timed is only the per-step Python the
runtime does around the model: on a GPU that work is serial with the kernels (the step's one
host sync is the sampler's), so it adds to every decode step. The sampling kernels are stubbed
as well (on a GPU they are asynchronous launches; their CPU reference versions would time
arithmetic, not overhead), so the sampler phase is its host-side setup alone.

Steady-state decode: B sequences with prompts of ``--context-len`` tokens are prefilled, then
``--steps`` decode steps are timed (after a few warm-up steps). Phases per step:

- schedule:   ``Scheduler.schedule()``
- prepare:    ``ModelRunner`` eager input build (ids, positions, slots, block tables -> tensors)
- graph in:   the host side of a decode-graph replay (inputs into the graph's buffers), run
              against CPU buffers (no graph is replayed)
- model:      the stub forward
- sampler:    ``Sampler`` with stubbed kernels
- postprocess: ``Scheduler.postprocess`` plus the drive loop's glue
- eager step / graph step: schedule + (prepare + model | graph in) + sampler + postprocess

Usage: python benchmarks/step_overhead.py [--batch 128,256] [--steps 50] [--context-len 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

PHASES = ("schedule", "prepare", "graph in", "model", "sampler", "postprocess")


class StubModel:
    """Stands in for an ``InferenceModel``: the same call signature, zero fp32 logits at once."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        return 1, 1, 8, 8  # (layers, kv heads, head dim K, head dim V): a tiny cache

    def __call__(self, ids, positions, context, rows) -> torch.Tensor:
        return torch.zeros(rows.shape[0], self.vocab)


def stub_sampling_kernels() -> None:
    """Replace the sampler's kernels by instant stand-ins (token 0, logprob 0)."""
    import vexact_models.runtime.sampler as sampler

    sampler.sample_tokens = lambda logits, *args: torch.zeros(logits.shape[0], dtype=torch.int64)
    sampler.gather_logprobs = lambda logits, *args: torch.zeros(logits.shape[0])
    sampler.filter_thresholds = lambda logits, *args: torch.zeros(logits.shape[0])


class Engine:
    """The runtime's pieces wired as ``LLM`` wires them, on CPU, with the stub model."""

    def __init__(self, batch: int, context_len: int, steps: int, block_size: int, vocab: int) -> None:
        from vexact_models.runtime import EngineConfig, Sampler

        max_len = context_len + steps + 64
        config = EngineConfig(num_blocks=batch * (-(-max_len // block_size)) + 16, block_size=block_size,
                              max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=max_len, eos_token_id=1)
        self.scheduler = config.make_scheduler()  # wired as LLM wires them
        self.runner = config.make_runner(StubModel(vocab), torch.device("cpu"), torch.float32, self.scheduler)
        self.sampler = Sampler(config.eos_token_id)
        self.graph_inputs = graph_input_builder(self.runner, batch)

    def add(self, batch: int, context_len: int, max_tokens: int, vocab: int, seed: int) -> None:
        from vexact_models.runtime import SamplingParams, Sequence

        rng = random.Random(seed)
        for i in range(batch):
            params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seed=i)
            prompt = [rng.randrange(2, vocab) for _ in range(context_len)]
            self.scheduler.add(Sequence(i, 0, prompt, params, seed=i))

    def step(self, times: dict[str, list[float]] | None) -> bool:
        """One step of ``LLM._loop``, phase by phase; returns whether it was decode-only."""
        clock = time.perf_counter
        t0 = clock()
        step = self.scheduler.schedule()
        t1 = clock()
        ids, positions, context, rows = self.runner._prepare(step.scheduled)
        t2 = clock()
        decode = all(item.num_new_tokens == 1 and item.samples for item in step.scheduled)
        if decode:
            self.graph_inputs(step.scheduled)
        t3 = clock()
        logits = self.runner.model(ids, positions, context, rows)
        t4 = clock()
        sampling = [item.seq for item in step.scheduled if item.samples]
        tokens, logprobs = self.sampler(logits, sampling)
        t5 = clock()
        if len(sampling) < len(step.scheduled):
            it_t, it_l = iter(tokens), iter(logprobs)
            tokens = [next(it_t) if item.samples else None for item in step.scheduled]
            logprobs = [next(it_l) if item.samples else None for item in step.scheduled]
        self.scheduler.postprocess(step.scheduled, tokens, logprobs)
        t6 = clock()
        if times is not None:
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                times[name].append(b - a)
        return decode


def graph_input_builder(runner, batch: int):
    """The host side of a decode-graph replay (inputs built, staged, copied into the graph's
    buffers) against CPU buffers: ``StepGraphs.run`` without the replay."""
    from vexact_models.runtime.graph_inputs import GraphInputs
    from vexact_models.runtime.step_inputs import build_step_inputs

    buffers = GraphInputs(batch, batch, runner.max_blocks_per_seq, torch.device("cpu"))

    def build(scheduled):
        inputs = build_step_inputs(scheduled, runner.block_size, runner.block_tables)
        buffers.fill(inputs, batch, batch)

    return build


def measure(batch: int, context_len: int, steps: int, warmup: int, block_size: int, vocab: int) -> dict:
    engine = Engine(batch, context_len, steps + warmup, block_size, vocab)
    engine.add(batch, context_len, max_tokens=steps + warmup + 32, vocab=vocab, seed=batch)
    while not engine.step(None):  # prefill (chunked by the token budget) until all decode
        pass
    for _ in range(warmup):
        engine.step(None)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(steps):
        assert engine.step(times), "a decode step was expected"
        assert engine.scheduler.num_running == batch
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="128,256", help="comma-separated batch sizes (running sequences)")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    parser.add_argument("--context-len", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024, help="stub vocabulary (logits width)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b]
    if not batches or min(batches) < 1 or args.steps < 1 or args.context_len < 1:
        parser.error("--batch, --steps and --context-len must be positive")
    torch.set_num_threads(args.threads)
    stub_sampling_kernels()
    print(f"host microseconds per decode step (median of {args.steps}), context {args.context_len}, "
          f"block size {args.block_size}, torch {torch.__version__}")
    header = ["batch", *PHASES, "eager step", "graph step"]
    print("".join(f"{h:>12}" for h in header))
    for batch in batches:
        t = measure(batch, args.context_len, args.steps, args.warmup, args.block_size, args.vocab)
        common = t["schedule"] + t["sampler"] + t["postprocess"]
        row = [batch, *(t[p] for p in PHASES), common + t["prepare"] + t["model"], common + t["graph in"]]
        print(f"{row[0]:>12}" + "".join(f"{v:>12.0f}" for v in row[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
