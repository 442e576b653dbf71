"""Timing helpers shared by the benchmark scripts (CUDA only)."""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from vexact_models.cli_args import positive_int  # noqa: F401 (the scripts' import)
from vexact_models.kernels import linear_quack
from vexact_models.kernels.paged_layout import shuffled_block_table

from decode_floor import decode_bytes, expected_routed, workload_decode_roofline  # noqa: F401 (the scripts' import)


def gpu_share(text: str) -> float:
    """``--gpu-memory-utilization``: a share of the GPU's memory in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse ``type`` for comma-separated counts that must each be >= 1 (row counts, batch
    sizes): the parser then names the option, the value and what it expected."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 128,256, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def shape_arg(text: str) -> tuple[int, int]:
    """An argparse ``type`` for ``SEQSxTOKENS`` (sequences of that many tokens), each >= 1 (tokens >= 2)."""
    try:
        seqs, tokens = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SEQSxTOKENS, e.g. 8x2048, got {text!r}") from None
    if seqs < 1 or tokens < 2:
        raise argparse.ArgumentTypeError(f"sequences must be >= 1 and tokens >= 2, got {text!r}")
    return seqs, tokens


def subset_arg(choices: tuple[str, ...]):
    """An argparse ``type`` for ``--parts``-like options: a comma-separated, non-empty subset of
    `choices`, as a list in the order given."""
    def parse(text: str) -> list[str]:
        parts = [p for p in text.split(",") if p]
        unknown = [p for p in parts if p not in choices]
        if unknown or not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return parts
    return parse


def check_overrides(parser: argparse.ArgumentParser, items: list[str] | None, names: list[str],
                    tiny: bool = False) -> None:
    """``--set`` items applied to the config of each of `names` (its tiny shape with ``--tiny``) where
    the options are parsed, on the host, before any model is built: a malformed item or a field the
    config lacks is a usage error naming it, not a traceback after the parsing."""
    if not items:
        return
    from vexact_models.conformance.models import architecture_of, make_config, parse_overrides

    try:
        overrides = parse_overrides(items)
        for name in names:
            make_config(architecture_of(name), None if tiny else name, None, None, overrides)
    except ValueError as err:
        parser.error(str(err))


def gluon_candidates(text: str, form: str = "ROWSxWARPSxSTAGES", example: str = "64x4x3") -> list[tuple[int, ...]]:
    """An argparse ``type`` for comma-separated launches of as many counts each as `form` names
    (by default a Gluon launch's query rows a program, warps, stages), each >= 1: the parser then
    names the option and the value. Bind `form` and `example` with `functools.partial` for another
    launch's counts."""
    launches = []
    for item in text.split(","):
        try:
            counts = tuple(int(v) for v in item.split("x"))
        except ValueError:
            counts = ()
        if len(counts) != len(form.split("x")):
            raise argparse.ArgumentTypeError(f"a candidate is {form}, e.g. {example}, got {item!r}")
        if min(counts) < 1:
            raise argparse.ArgumentTypeError(f"every count of a candidate must be >= 1, got {item!r}")
        launches.append(counts)
    return launches


def case_selected(name: str, spec: str | None) -> bool:
    """Whether a `--cases` option keeps the case `name`: `spec` is comma-separated substrings of
    case names, and an empty (or None) `spec` keeps every case."""
    keep = [c for c in (spec or "").split(",") if c]
    return not keep or any(k in name for k in keep)


def gluon_unavailable(script: str) -> str | None:
    """Why `script` cannot time a Gluon kernel on this machine (no CUDA GPU, not Hopper, a Triton
    whose Gluon the kernels were not checked under), or None."""
    if not torch.cuda.is_available():
        return f"{script} needs a CUDA GPU (Hopper for the Gluon kernel)"
    from vexact_models.kernels import gluon_support

    if not gluon_support.HAS_GLUON or torch.cuda.get_device_capability()[0] < 9:
        return (f"{script}: the Gluon kernel needs a Hopper GPU and a verified Triton "
                f"({gluon_support.GLUON_VERIFIED})")
    return None


def tiny_or_cuda(args: argparse.Namespace, script: str) -> None:
    """Set ``args.device`` and ``args.dtype`` of a script with a ``--tiny`` CPU smoke run (CPU,
    float32) beside its GPU run (CUDA, bf16); without a CUDA GPU and without ``--tiny``, say so
    and exit 2."""
    args.device = torch.device("cpu" if args.tiny else "cuda")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        sys.exit(2)


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): host timers then read device time."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_seconds(run, device: torch.device | str) -> dict[str, float]:
    """Seconds per kernel name of one call of `run` under torch's profiler: GPU time on CUDA, on
    the CPU each op's own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        synchronize(torch.device(device))
    times = ((e.key, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in prof.key_averages())
    return {name: us * 1e-6 for name, us in times if us > 0}


def timed(fn, device: torch.device, repeat: int = 3) -> float:
    """Median wall seconds of `fn` over `repeat` calls after one warm-up, `device` synchronised
    around each: for calls of milliseconds and more (a weight sync), on any device."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of `fn` (CUDA events, via triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture_graph(fns, reps: int = 1) -> torch.cuda.CUDAGraph:
    """`fns` run back to back, `reps` times, captured in one CUDA graph, after one warm-up call of
    each on a side stream (Triton and quack compile, cuBLAS sets up its workspace, outside the
    capture: `linear_quack.as_in_capture`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), linear_quack.as_in_capture():
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    return graph


def bench_graph(fns, reps: int = 10, replays: int = 7) -> float:
    """Median milliseconds per call of `fns` run back to back, `reps` times, inside one CUDA graph:
    GPU time without host launch overhead, as in a decode step's graph (`bench`'s loop of host
    launches measures the host instead for kernels of a few microseconds). Pass functions that
    read different copies of their large operands (`rotating_copies`) so that they come from HBM,
    not from the L2 cache the previous call filled."""
    graph = capture_graph(fns, reps)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    del graph
    return sorted(times)[len(times) // 2]


def graph_us_or_none(fn) -> float | None:
    """Microseconds of `fn` alone in a CUDA graph (`bench_graph`), or None where its launch does
    not fit the GPU (a launch-shape sweep's candidate out of resources; the error is printed on
    stderr)."""
    try:
        return bench_graph([fn]) * 1e3
    except Exception as exc:  # out of resources for a launch shape
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
        return None


def _bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of their width: equal exactly where the bits are."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bits_at_row_counts(run, want: torch.Tensor, ms: list[int]) -> tuple[int, int, int, str]:
    """``run(m)`` (the first `m` rows of a launch) against ``want[:m]``, bitwise, for each row count
    of `ms`: (rows compared, rows differing, elements differing, the error that stopped it or "").
    A launch that does not build (a candidate config) is reported, not raised."""
    rows, bad_rows, bad_elements = 0, 0, 0
    for m in ms:
        try:
            got = run(m)
        except Exception as exc:  # noqa: BLE001 - a config that does not build is reported
            return rows, bad_rows, bad_elements, f"{type(exc).__name__}: {str(exc)[:100]}"
        differ = _bit_patterns(got) != _bit_patterns(want[:m])  # -0.0 vs 0.0 and NaN payloads count
        rows += m
        bad_rows += int(differ.reshape(m, -1).any(dim=1).sum())
        bad_elements += int(differ.sum())
    return rows, bad_rows, bad_elements, ""


def rotating_copies(tensor: torch.Tensor, max_copies: int = 16) -> list[torch.Tensor]:
    """`tensor` and enough copies of it that cycling through them overflows the L2 cache three
    times over (at least 2, at most `max_copies`)."""
    l2 = torch.cuda.get_device_properties(tensor.device).L2_cache_size
    count = min(max_copies, max(2, -(-3 * l2 // (tensor.numel() * tensor.element_size()))))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written): the HBM reference (on the
    CPU, of `--tiny` runs: a 64 MiB host copy, timed by the wall clock)."""
    device = torch.device(device)
    if device.type != "cuda":
        src = torch.empty(1 << 26, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return 2 * (1 << 26) / timed(lambda: dst.copy_(src), device) / 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * (1 << 30) / ms / 1e6


def decode_layout(batch: int, context: int | list[int], page: int, device="cuda"):
    """A decode step's `PagedLayout` on `device` (the GPU by default): `batch` sequences of one new
    token each over `context` cached positions (one count for all, or one per sequence), their
    pages (``ceil(context / page)`` each, numbered from 0) shuffled over the cache as a running
    engine leaves them."""
    from vexact_models.kernels import PagedLayout

    lens = [context] * batch if isinstance(context, int) else list(context)
    if len(lens) != batch:
        raise ValueError(f"decode_layout: {len(lens)} context lengths for batch={batch}")
    return PagedLayout(torch.arange(batch + 1, dtype=torch.int32, device=device),
                       torch.tensor(lens, dtype=torch.int32, device=device), shuffled_block_table(lens, page).to(device),
                       page, 1)


def prompt_layout(q_lens: list[int], seq_lens: list[int], page: int, gen: torch.Generator | None = None,
                  packed: bool = False, device="cuda"):
    """``(layout, slots)`` of a prefill launch on `device`: sequences of `seq_lens` keys whose last
    `q_lens` are new query tokens, over `shuffled_block_table` pages of `page` slots (`gen`'s
    shuffle), or (`packed`) the training layout of consecutive rows where every key is a query
    (`q_lens` must equal `seq_lens`). `slots`: the rows a K/V tensor needs."""
    from vexact_models.kernels import PagedLayout
    from vexact_models.kernels.attention import packed_layout

    if packed:
        if list(q_lens) != list(seq_lens):
            raise ValueError(f"prompt_layout: packed=True needs q_lens == seq_lens, got {q_lens} and {seq_lens}")
        cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32, device=device)
        return packed_layout(cu, max(seq_lens)), sum(seq_lens)
    table_ = shuffled_block_table(seq_lens, page, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    layout = PagedLayout(cu, torch.tensor(seq_lens, dtype=torch.int32, device=device), table_.to(device), page,
                         max(q_lens))
    return layout, sum(-(-n // page) for n in seq_lens) * page


def causal_pairs(q_lens: list[int], seq_lens: list[int]) -> int:
    """Query-key pairs a causal launch computes: each of a sequence's last `q_lens` tokens sees
    every key up to its own position (the FLOP count of attention, per head and dim)."""
    return sum(sum(range(n - q + 1, n + 1)) for q, n in zip(q_lens, seq_lens))


def stock_attention(arch) -> str:
    """The attention implementation stock transformers runs `arch` with in the benchmarks: ``sdpa``
    (the stock fast path) where its class supports it, else ``eager`` (GPT-OSS: its sinks have no
    sdpa path in transformers; its other choices, flex attention and the kernels hub's
    FlashAttention-3 with sinks, need compilation or a download)."""
    return "sdpa" if getattr(arch.hf_class(), "_supports_sdpa", True) else "eager"


def stock_twin(arch, model):
    """The stock transformers class of `arch` (`stock_attention`: sdpa where it has it) holding
    `model`'s weights: the peer that training.py and throughput.py time beside ours. It is
    built directly on `model`'s device in its dtype (`conformance.models.hf_twin`): an 8B model's
    random initialisation on the CPU takes minutes, and the Qwen3-8B training points built that way
    did not finish within a 330 s device call (H200, 2026-11-28)."""
    from vexact_models.conformance.models import hf_twin

    return hf_twin(arch, model, attn_implementation=stock_attention(arch), stock_experts=True)


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(f"{r[i]}") for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(f"{c}".rjust(w) for c, w in zip(r, widths)))


#: a quack `GemmConfig` as a benchmark option: tile M x N, pingpong or cooperative, cluster, swap-AB
CONFIG_SPEC = re.compile(r"^(\d+)x(\d+)([pc])(?::(\d+)x(\d+))?(s?)$")


def parse_config(spec: str):
    """A `linear_quack.QuackConfig` from ``TMxTN{p|c}[:CMxCN][s]``: tile M x N, pingpong or
    cooperative, cluster (default 1x1), ``s`` for swap-AB. E.g. ``64x64p:2x1``, ``128x64ps``."""
    from vexact_models.kernels.linear_quack import QuackConfig

    match = CONFIG_SPEC.match(spec.strip())
    if match is None:
        raise ValueError(f"quack config {spec!r}: expected TMxTN{{p|c}}[:CMxCN][s], e.g. 64x64p:2x1 or 128x64ps")
    tm, tn, kind, cm, cn, swap = match.groups()
    return QuackConfig(int(tm), int(tn), kind == "p", int(cm or 1), int(cn or 1), swap == "s")


def config_label(cfg) -> str:
    """The spec `parse_config` reads back, ``(default)`` marking quack's own SM90 default."""
    from vexact_models.kernels.linear_quack import SM90_DEFAULT

    spec = (f"{cfg.tile_m}x{cfg.tile_n}{'p' if cfg.pingpong else 'c'}"
            f"{f':{cfg.cluster_m}x{cfg.cluster_n}' if (cfg.cluster_m, cfg.cluster_n) != (1, 1) else ''}"
            f"{'s' if cfg.swap_ab else ''}")
    return spec + (" (default)" if cfg == SM90_DEFAULT else "")
