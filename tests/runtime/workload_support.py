"""Random scheduler workloads for the host-side runtime tests (no model): prompts with common
prefixes (prefix sharing), n > 1, tight caches (preemption), chunked and unchunked prefill."""

import random

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence

EOS = 1


def random_workload(seed: int) -> tuple[dict, list[tuple[list[int], SamplingParams]]]:
    """(scheduler settings, [(prompt, params)]) drawn from ``seed``."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    config = dict(block_size=bs, num_blocks=rng.randint(8, 80) if bs < 16 else rng.randint(4, 30),
                  sharing=rng.random() < 0.7, max_num_seqs=rng.randint(1, 12), budget=rng.randint(8, 64),
                  max_model_len=rng.randint(20, 120), chunked=True)
    if rng.random() < 0.3:
        config["chunked"] = False
        config["budget"] = max(config["budget"], config["max_model_len"])
    common = [rng.randrange(2, 60) for _ in range(40)]
    requests = []
    for _ in range(rng.randint(1, 10)):
        length = rng.randint(1, 30)
        prompt = common[:length] if rng.random() < 0.5 else [rng.randrange(2, 60) for _ in range(length)]
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=max_tokens,
                                min_tokens=rng.randint(0, min(max_tokens, 3)), stop_token_ids=rng.choice([[], [5]]))
        requests.append((prompt, params))
    return config, requests


def make_scheduler(config: dict, requests) -> tuple[Scheduler, list[Sequence]]:
    bm = BlockManager(config["num_blocks"], config["block_size"], enable_prefix_sharing=config["sharing"])
    sched = Scheduler(bm, config["max_num_seqs"], config["budget"], config["max_model_len"], EOS,
                      chunked_prefill=config["chunked"])
    seqs = []
    for r, (prompt, params) in enumerate(requests):
        for i in range(params.n):
            seq = Sequence(r, i, prompt, params, seed=r * 10 + i)
            sched.add(seq)
            seqs.append(seq)
    return sched, seqs


def fake_token(seq: Sequence) -> int:
    """A pure function of the sequence's seed and length (like the counter-based sampler)."""
    return 2 + (seq.seed * 7919 + seq.num_tokens * 104729) % 58  # sometimes the stop token 5


def run_steps(sched: Scheduler, max_steps: int = 5000):
    """Drive ``sched`` to completion, yielding each step's output before its postprocess."""
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        yield out
        if out.scheduled:
            tokens = [fake_token(item.seq) if item.samples else None for item in out.scheduled]
            logprobs = [-1.0 if item.samples else None for item in out.scheduled]
            sched.postprocess(out.scheduled, tokens, logprobs)
    raise AssertionError("the workload did not finish")
