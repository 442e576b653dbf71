"""What structured outputs cost a decode step (`runtime.grammar_masks`), beside xgrammar's own
mask kernel: for each regex, R rows' matchers over a word-level tokenizer of the model's whole
vocabulary (`throughput_engines.word_tokenizer`) walk a few steps (each row takes a random allowed
token), and each step times

- the host fill of the R masks: xgrammar's batch fill (threads, what the engine runs) and one
  matcher at a time;
- our mask application (`GrammarMasks.apply`: the copy of the logits with the disallowed tokens at
  -inf) beside xgrammar's ``apply_token_bitmask_inplace`` on a copy (the peer; the same bits).

    cd benchmarks && python3 grammar_masks.py --rows 256 --regex '([a-z]+ )+[0-9]' '([a-z]{1,6} )+[0-9]'
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from bench_utils import synchronize
from throughput_engines import STRUCTURED_REGEX, word_tokenizer


def measure(regex: str, rows: int, vocab: int, steps: int, device: torch.device, rng) -> list[tuple]:
    """(step, allowed tokens per row, batch fill ms, one-at-a-time fill ms, apply ms, peer ms) per step."""
    import xgrammar as xgr

    from vexact_models.runtime.grammar_masks import GrammarMasks, allowed_tokens
    from vexact_models.runtime.structured_outputs import Grammars, StructuredOutputsParams

    grammars = Grammars(word_tokenizer(transformers.Qwen3Config(vocab_size=vocab, eos_token_id=vocab - 1)), vocab,
                        [vocab - 1])
    compiled = grammars.compile(StructuredOutputsParams(regex=regex))
    matchers = [grammars.matcher(compiled) for _ in range(rows)]
    bits = torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher()
    logits = torch.randn(rows, vocab, device=device)
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bits)
        t1 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bits, i)
        t2 = time.perf_counter()
        dev_bits = bits.to(device)
        masks = GrammarMasks(torch.arange(rows, device=device), dev_bits, every_row=True)
        ours, peer = _time(lambda: masks.apply(logits), device), _time(lambda: _peer(logits, dev_bits), device)
        assert torch.equal(masks.apply(logits), _peer(logits, dev_bits))
        allowed = allowed_tokens(dev_bits, vocab).cpu().numpy()
        for m, row in zip(matchers, allowed):
            assert m.accept_token(int(rng.choice(np.flatnonzero(row))))
        out.append((step, allowed.sum(1).mean(), 1e3 * (t1 - t0), 1e3 * (t2 - t1), ours, peer))
    return out


def _peer(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    import xgrammar as xgr

    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bits)
    return out


def _time(fn, device: torch.device, repeat: int = 5) -> float:
    """Milliseconds of `fn` (the median of `repeat` calls, the device synchronised around each)."""
    times = []
    for _ in range(repeat + 1):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times[1:]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="constrained rows a step (default 256)")
    parser.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (default Qwen3's)")
    parser.add_argument("--steps", type=int, default=4, help="steps each regex walks (default 4)")
    parser.add_argument("--regex", nargs="+", default=[STRUCTURED_REGEX, "([a-z]{1,6} )+[0-9]"],
                        help="regexes over lowercase words and spaces (default: throughput.py's aligned-regex one, "
                             "and one that bounds each word's length)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.vocab < 64 or args.steps < 1:
        parser.error(f"--rows {args.rows}, --vocab {args.vocab}, --steps {args.steps}: need >= 1, >= 64, >= 1")
    rng = np.random.default_rng(0)
    print(f"{args.rows} rows, vocabulary {args.vocab:,}, {args.device}; ms a step")
    print(f"{'regex':24} {'step':>4} {'allowed':>9} {'fill':>8} {'fill 1x1':>9} {'apply':>7} {'xgrammar':>9} {'vs':>6}")
    for regex in args.regex:
        for step, allowed, fill, serial, ours, peer in measure(regex, args.rows, args.vocab, args.steps,
                                                               torch.device(args.device), rng):
            print(f"{regex:24} {step:>4} {allowed:>9,.0f} {fill:>8.2f} {serial:>9.2f} {ours:>7.3f} {peer:>9.3f} "
                  f"{peer / ours:>5.2f}x")


if __name__ == "__main__":
    main()
