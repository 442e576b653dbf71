"""Agent-loop clients against the OpenAI-compatible server (`runtime.openai_server`): each request
joins the running batch at the next step (`LLM.add_request` / `step`). Beside it, in the same run:
the same online requests submitted in process (`runtime.engine_thread`, no HTTP), and the same
engine driven by whole calls, one ``generate`` over whatever requests wait, each new arrival
waiting for the running call to finish (as verl's `VexactServer` drives it).

Workload: ``--clients`` clients, each a closed loop of ``--turns`` turns: the first prompt
``--prompt-len`` random token ids, each next prompt the conversation so far plus ``--user-len``
new ones; each turn's ``max_tokens`` drawn from [``--min-tokens``, ``--max-tokens``] (``ignore_eos``,
a seed per client and turn), so that turns end at different times, as an agent's tool calls do.
A client sends its next turn when it has the reply. Model: random weights at a bundled published
config, bf16, CUDA; a word-level tokenizer over its vocabulary. The online clients talk HTTP
(``/v1/completions``, token-id prompts, ``return_token_ids``, ``logprobs: 0``) from a process of
their own (threads there); the others are threads of this process handing their requests over.

Table: per mode the wall time, the output tokens, tok/s, the turn latency (mean, p90), and the
engine's steps (how many, the mean interval between their completions, the sequences in each) and
the mixed-step CUDA graphs captured during the mode (with the host time they took: each costs its
step tens of ms; an untimed in-process pass of the whole workload captures most of them first)
and its eager steps (no graph holds them: ~25 ms of host time each at Qwen3-0.6B); the ratios
online / per-call. Then whether all modes gave every turn the same tokens and logprobs (they
must: a request's tokens depend only on it, rules 1 and 7, and the conversations then stay the
same), and every online sample recomputed by ``token_logprobs``.

Usage (one H100 or H200; the second pass's rows are the steady state):
    cd benchmarks && python3 serve.py --config qwen3-0.6b --repeat 2
    cd benchmarks && python3 serve.py --tiny            # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import multiprocessing
import pstats
import queue
import random
import threading
import time
import urllib.request
from dataclasses import replace

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from bench_models import build_published, recompute_mismatches
from bench_utils import gpu_share, positive_int, table, tiny_or_cuda
from vexact_models.runtime import LLM, RequestOutputKind, SamplingParams
from vexact_models.runtime.engine_thread import EngineThread
from vexact_models.runtime.openai_server import OpenAIServer

CONFIGS = ("qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-0.6b", choices=CONFIGS, help="bundled published config (qwen3-0.6b)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    p.add_argument("--clients", type=positive_int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns a client makes (default 4)")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="first prompt's tokens (default 512)")
    p.add_argument("--user-len", type=positive_int, default=64, help="tokens added after each reply (default 64)")
    p.add_argument("--min-tokens", type=positive_int, default=16, help="fewest tokens a reply asks for (default 16)")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="most tokens a reply asks for (default 512)")
    p.add_argument("--gpu-memory-utilization", type=gpu_share, default=0.85, help="the engine's share of the GPU")
    p.add_argument("--recompute-tokens", type=positive_int, default=16384, help="tokens a recompute micro-batch holds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run the modes this many times in turn, a row each (later runs capture no new graphs)")
    p.add_argument("--profile-engine", action="store_true",
                   help="print where each mode's engine thread spends its time (cProfile, top functions)")
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the architecture's tiny config (tests)")
    args = p.parse_args(argv)
    if args.min_tokens > args.max_tokens:
        p.error(f"--min-tokens {args.min_tokens} is above --max-tokens {args.max_tokens}")
    if args.tiny:
        args.clients, args.turns, args.prompt_len, args.user_len, args.min_tokens, args.max_tokens = 4, 3, 12, 4, 2, 8
    tiny_or_cuda(args, "benchmarks/serve.py")
    return args


def word_tokenizer(vocab_size: int):
    """Token i is the word ``w<i>``: text for every id of the model's vocabulary."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


class Client:
    """One conversation: its turns' requests, built from the replies so far."""

    def __init__(self, index: int, args, vocab: int) -> None:
        self.rng = random.Random(args.seed * 7919 + index)
        self.index, self.args, self.vocab = index, args, vocab
        self.history = [self.rng.randrange(vocab) for _ in range(args.prompt_len)]
        self.turns: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, tokens, logprobs)
        self.latencies: list[float] = []

    def request(self, turn: int) -> tuple[list[int], SamplingParams]:
        args = self.args
        max_tokens = self.rng.randint(args.min_tokens, args.max_tokens)
        return list(self.history), SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                                  seed=self.index * 1000 + turn, detokenize=False)

    def record(self, prompt: list[int], tokens: list[int], logprobs: list[float], seconds: float) -> None:
        self.turns.append((prompt, tokens, logprobs))
        self.latencies.append(seconds)
        self.history = prompt + tokens + [self.rng.randrange(self.vocab) for _ in range(self.args.user_len)]


def run_clients(args, vocab: int, ask) -> tuple[list[Client], float]:
    """Every client's turns, `ask(prompt, params) -> (tokens, logprobs)` from its own thread."""
    clients = [Client(i, args, vocab) for i in range(args.clients)]

    def loop(client: Client) -> None:
        for turn in range(args.turns):
            prompt, params = client.request(turn)
            start = time.perf_counter()
            tokens, logprobs = ask(prompt, params)
            client.record(prompt, tokens, logprobs, time.perf_counter() - start)

    threads = [threading.Thread(target=loop, args=(c,)) for c in clients]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return clients, time.perf_counter() - start


def http_ask(url: str):
    """`run_clients`' request function over HTTP: ``/v1/completions`` with token ids back."""
    def ask(prompt, params):
        body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "seed": params.seed, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
        request = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as reply:
            choice = json.loads(reply.read())["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    return ask


def http_clients(url: str, args, vocab: int):
    """The clients over HTTP, run in a process of their own (as a server's clients are)."""
    return run_clients(args, vocab, http_ask(url))


def online(llm, args, vocab: int):
    server = OpenAIServer(llm, "bench", port=0).start()
    try:
        if args.tiny:  # (no second process in the CPU smoke run)
            return http_clients(server.url, args, vocab)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(http_clients, (server.url, args, vocab))
    finally:
        server.close()


def in_process(llm, args, vocab: int):
    """The same online requests without HTTP: each client submits to the engine thread directly."""
    engine = EngineThread(llm)

    def ask(prompt, params):
        output = engine.submit(prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY)).result()
        return output.outputs[0].token_ids, output.outputs[0].logprobs

    try:
        return run_clients(args, vocab, ask)
    finally:
        engine.close()


def per_call(llm, args, vocab: int):
    """The engine driven by whole calls: the calling thread runs ``generate`` over the waiting requests."""
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    done = threading.Event()

    def ask(prompt, params):
        slot: queue.SimpleQueue = queue.SimpleQueue()
        waiting.put((prompt, params, slot))
        return slot.get()

    def drive() -> None:
        while not done.is_set():
            try:
                batch = [waiting.get(timeout=0.05)]
            except queue.Empty:
                continue
            while not waiting.empty():
                batch.append(waiting.get())
            outputs = llm.generate([b[0] for b in batch], [b[1] for b in batch], use_tqdm=False)
            for (_, _, slot), output in zip(batch, outputs):
                slot.put((output.outputs[0].token_ids, output.outputs[0].logprobs))

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        return run_clients(args, vocab, ask)
    finally:
        done.set()
        driver.join()


@contextlib.contextmanager
def engine_profile(name: str, enabled: bool):
    """With `enabled`, profile the engine threads started inside (`EngineThread._run`) and the
    per-call mode's `LLM.generate`, and print their top functions by own time."""
    if not enabled:
        yield
        return
    profile = cProfile.Profile()
    run, generate = EngineThread._run, LLM.generate
    EngineThread._run = lambda self: profile.runcall(run, self)
    LLM.generate = lambda self, *a, **k: profile.runcall(generate, self, *a, **k)
    try:
        yield
    finally:
        EngineThread._run, LLM.generate = run, generate
        print(f"\n## where the engine's thread spent its time: {name}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def graph_counts(llm) -> tuple[int, int, float]:
    """The engine's mixed-step CUDA graphs so far (captured on a bucket's first use,
    `runtime.cuda_graphs`), its eager steps (no graph holds them) and the host seconds the
    captures took."""
    graphs = llm.runner.graphs
    return (0, 0, 0.0) if graphs is None else (graphs.num_mixed, graphs.eager_steps, graphs.mixed_capture_seconds)


def row(name: str, clients: list[Client], seconds: float, steps: list[tuple[int, bool, float]],
        graphs: tuple[int, int, float]) -> list:
    tokens = sum(len(t[1]) for c in clients for t in c.turns)
    latencies = sorted(x for c in clients for x in c.latencies)
    busy = sum(s[2] for s in steps)  # the intervals between step completions (the engine's `step_times`)
    return [name, f"{seconds:.2f}", tokens, f"{tokens / seconds:,.0f}", f"{sum(latencies) / len(latencies):.3f}",
            f"{latencies[int(0.9 * (len(latencies) - 1))]:.3f}", len(steps), f"{1000 * busy / max(len(steps), 1):.2f}",
            f"{sum(s[0] for s in steps) / max(len(steps), 1):.1f}", f"{graphs[0]} ({graphs[2]:.2f} s)", graphs[1]]


def main(argv=None) -> None:
    args = parse_args(argv)
    _, config, model = build_published(args, max_positions=args.prompt_len + args.turns * (args.max_tokens + args.user_len))
    engine = dict(kv_cache_bytes=64 << 20) if args.tiny else dict(gpu_memory_utilization=args.gpu_memory_utilization)
    llm = LLM(model, tokenizer=word_tokenizer(config.vocab_size), owns_weights=True, **engine)
    vocab = min(config.vocab_size, 32000)
    # untimed: the whole workload once in process, so that the mixed-step graphs its steps use are
    # captured before any timed mode (each capture costs tens of ms, and the first mode would pay them)
    warm = argparse.Namespace(**{**vars(args), "clients": min(args.clients, 8), "turns": 1})
    in_process(llm, args, vocab)
    online(llm, warm, vocab)
    per_call(llm, warm, vocab)
    runs = {}
    for repeat in range(args.repeat):
        for name, mode in (("online (HTTP)", online), ("online (in process)", in_process), ("per-call generate", per_call)):
            name += f" #{repeat + 1}" if args.repeat > 1 else ""
            llm.reset_prefix_cache()
            llm.step_times, before = [], graph_counts(llm)
            with engine_profile(name, args.profile_engine):
                runs[name] = mode(llm, args, vocab)
            runs[name] += (llm.step_times, tuple(b - a for a, b in zip(before, graph_counts(llm))))
            print(f"{name}: {row(name, *runs[name])[1:]}", flush=True)  # (each mode as it ends: a run cut short keeps them)
    rows = [row(name, *run) for name, run in runs.items()]
    (served, online_s, *_), (local, local_s, *_), (called, call_s, *_) = list(runs.values())[-3:]  # (the last runs)
    table(f"{args.config}: {args.clients} clients x {args.turns} turns (replies of {args.min_tokens}-{args.max_tokens} "
          "tokens)", ["mode", "seconds", "output tokens", "tok/s", "mean latency s", "p90 latency s", "steps", "ms a step",
                        "sequences a step", "graphs captured", "eager steps"], rows)
    print(f"online / per-call: {call_s / online_s:.2f}x tok/s over HTTP, {call_s / local_s:.2f}x in process")
    same = all(a.turns == b.turns == c.turns for a, b, c in zip(served, local, called))
    print(f"every turn the same tokens and logprobs in all modes: {same}")
    samples = [turn for c in served for turn in c.turns]
    checked, bad, worst = recompute_mismatches(model, samples, args.recompute_tokens, args.device)
    print(f"recomputed by token_logprobs: {checked} tokens, {bad} mismatches (max |diff| {worst:.3g})")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
