"""Shared by the FSDP2 worker scripts (run under torchrun) and the tests that launch them.

Workers never assert: a failing rank would leave the others waiting in a collective. Each check
is recorded as ``{"ok": bool, "detail": str}`` in ``<out>/rank<r>.json`` and the pytest side
asserts on them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# -- the data every rank and the single-process reference agree on -------------------------------

def make_model(arch, seed: int = 0, **overrides):
    """A tiny fp32 model of `arch` with values that make logprobs non-trivial (the default init
    of 0.02 gives almost flat logits) and, where the architecture has one, a random
    expert-selection bias (so the routing depends on it). `overrides`: config fields."""
    torch.manual_seed(seed)
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.3, **overrides))
    if arch.init_for_conformance is not None:
        arch.init_for_conformance(model, seed)
    return model


def make_sequences(vocab: int, n: int = 12, seed: int = 1, lo: int = 3, hi: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def packed(seqs: list[list[int]]) -> dict:
    """HF's packed convention: one row, position_ids restarting at 0 per sequence."""
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]])
    return {"input_ids": ids, "position_ids": pos}


def padded(seqs: list[list[int]], left: bool) -> dict:
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


def per_sequence(lp: torch.Tensor, batch: dict, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logprobs out of a packed or padded result."""
    if "attention_mask" in batch:
        mask = batch["attention_mask"].bool()
        return [lp[i][mask[i]] for i in range(len(seqs))]
    flat, out, start = lp.reshape(-1), [], 0
    for s in seqs:
        out.append(flat[start:start + len(s)])
        start += len(s)
    return out


def splits(n: int, world: int) -> dict[str, list[list[list[int]]]]:
    """Data splits of sequence indices: per rank, a list of micro-batches (each non-empty; every
    rank the same number of micro-batches, since each is a collective)."""
    round_robin = [[[i for i in range(n) if i % world == r]] for r in range(world)]
    # uneven contiguous blocks, each in two micro-batches: rank r gets more than rank r - 1
    weights = [r + 1 for r in range(world)]
    sizes = [max(2, n * w // sum(weights)) for w in weights]
    sizes[-1] = n - sum(sizes[:-1])
    blocks, start = [], 0
    for size in sizes:
        idx = list(range(start, start + size))
        start += size
        blocks.append([idx[:size // 2], idx[size // 2:]])
    return {"round_robin": round_robin, "uneven_microbatched": blocks}


# -- recording ---------------------------------------------------------------------------------

class Results:
    def __init__(self) -> None:
        self.checks: dict[str, dict] = {}

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        if name in self.checks:  # one name, several occurrences: all must pass
            prev = self.checks[name]
            ok, detail = prev["ok"] and ok, prev["detail"] if not prev["ok"] else detail
        self.checks[name] = {"ok": bool(ok), "detail": detail}

    def exception(self, name: str, exc: BaseException) -> None:
        self.record(name, False, f"{type(exc).__name__}: {exc}")

    def save(self, out: Path, rank: int) -> None:
        (out / f"rank{rank}.json").write_text(json.dumps(self.checks, indent=1))


def equal_lists(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[bool, str]:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
    if len(got) != len(want):
        return False, f"{len(got)} results for {len(want)} sequences"
    if bad:
        i = bad[0]
        return False, f"{len(bad)} sequence(s) differ, first #{i}: max |diff| {(got[i] - want[i]).abs().max().item():.3g}"
    return True, f"{len(got)} sequences bitwise equal"


# -- launching -----------------------------------------------------------------------------------

def torchrun(script: str, nprocs: int, out: Path, *args: str, timeout: int = 420, cuda: bool = False) -> dict[int, dict]:
    """Run `script` (a file beside this one, or a path) on `nprocs` CPU ranks (gloo) with torchrun
    (`cuda`: the GPUs left visible to them); return each rank's recorded checks. A failed launch
    raises with the processes' output."""
    path = script if os.path.isabs(script) else str(HERE / script)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", path,
           "--out", str(out), *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}")
    results = {}
    for r in range(nprocs):
        results[r] = json.loads((out / f"rank{r}.json").read_text())
    return results


def run_rank(run, out: Path) -> None:
    """One torchrun rank: init gloo, ``run(res, rank, world)``, save this rank's checks to `out`.
    A crash is recorded as the check ``crash`` (not raised: the other ranks may be in a
    collective) and its traceback printed."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = Results()
    try:
        run(res, rank, world)
    except Exception as exc:  # recorded, not raised
        res.exception("crash", exc)
        import traceback

        traceback.print_exc()
    res.save(out, rank)
    dist.destroy_process_group()


def assert_passed(results: dict[int, dict], prefix: str, world: int) -> None:
    """Every rank of `world` reported, none crashed (`run_rank`), and every check named
    `prefix`* passed (`failures`)."""
    assert sorted(results) == list(range(world))
    crashed = {r: c["crash"]["detail"] for r, c in results.items() if "crash" in c}
    assert not crashed, crashed
    bad = failures(results, prefix)
    assert not bad, "\n".join(bad)


def failures(results: dict[int, dict], prefix: str) -> list[str]:
    """'rank r: check: detail' for every failed check whose name starts with `prefix`; also
    fails when no such check was recorded (a check that never ran cannot pass)."""
    seen, bad = 0, []
    for rank, checks in results.items():
        for name, res in checks.items():
            if name.startswith(prefix):
                seen += 1
                if not res["ok"]:
                    bad.append(f"rank {rank}: {name}: {res['detail']}")
    return bad if seen else [f"no check named {prefix}* was recorded"]
