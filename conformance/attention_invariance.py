"""The attention kernels' invariance checks of `kernel_invariance` (docs/design.md rule 2), on a
GPU: each query's output packed (training), each sequence packed alone, and over a paged cache
in chunked prefill / decode schedules; the latent MLA kernel likewise over a latent cache (V a
view of K); every launch-parameter candidate `pick_config` may choose against the first; and the
rollout's fused latent prologue (`latent_cache_write`) against the separate ops training runs."""

from __future__ import annotations

import random

import torch

from vexact_models.kernels import PagedLayout, attention, attention_packed, kv_cache_write, latent_cache_write, rope_table
from vexact_models.kernels.attention import AttentionConfig, attention_triton, kv_descriptors_fit, packed_layout
from vexact_models.kernels.attention_forward_choice import forward_mode
from vexact_models.kernels.latent_attention import LatentConfig, key_block, latent_attention_triton
from vexact_models.kernels.latent_cache_write import latent_cache_write_reference
from vexact_models.kernels.paged_layout import shuffled_block_table, slots_reference

from .invariance_result import Result

# (name, q heads, kv heads, query/key head dim, value head dim, sliding window, sinks); the
# windowed shapes (docs/design.md rule 2, "windows and sinks") have windows shorter than the
# longer sequences, so that both a tile's skipped blocks and a row's masked ones are exercised
ATTENTION_SHAPES = [("qwen3-0.6b", 16, 8, 128, 128, None, False), ("qwen3-8b", 32, 8, 128, 128, None, False),
                    ("qwen3-30b-a3b", 32, 4, 128, 128, None, False), ("gqa-d64", 8, 2, 64, 64, None, False),
                    ("moonlight MLA", 16, 16, 192, 128, None, False), ("deepseek-v3 MLA", 128, 128, 192, 128, None, False),
                    ("qwen3.5-35b-a3b", 16, 2, 256, 256, None, False), ("qwen3.5-text", 16, 4, 256, 256, None, False),
                    ("gpt-oss sliding 128 sinks", 64, 8, 64, 64, 128, True), ("gpt-oss full sinks", 64, 8, 64, 64, None, True),
                    ("gemma3-4b sliding 1024", 8, 4, 256, 256, 1024, False),
                    ("mistral-7b sliding 4096", 32, 8, 128, 128, 4096, False)]
# (name, q heads, kv_lora_rank, rope dims, qk_nope, v_head_dim): MLA with kv_b_proj absorbed (latent KV cache)
LATENT_SHAPES = [("moonlight latent MLA", 16, 512, 64, 128, 128), ("deepseek-v3 latent MLA", 128, 512, 64, 128, 128)]


def check_attention_configs(result: Result, hq: int, hkv: int, d: int, dv: int, latent: bool, window: int | None = None,
                            sinks: bool = False) -> None:
    """Every launch-parameter candidate `pick_config` may choose (tiles of 16 to 128 rows, mma.sync
    or wgmma, any warps/stages, latent value chunks) gives bitwise the output of the first (rule
    2), on packed sequences of uneven lengths; with a sliding `window` and random `sinks` too."""
    lens = [1, 63, 64, 65, 700]
    t = sum(lens)
    q = torch.randn(t, hq, d, device="cuda").bfloat16()
    k = torch.randn(t, hkv, d, device="cuda").bfloat16()
    v = k[..., :dv] if latent else torch.randn(t, hkv, dv, device="cuda").bfloat16()
    layout = packed_layout(torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda"),
                           max(lens))
    options = dict(window=window, sinks=torch.randn(hq, device="cuda") if sinks else None)
    if latent:
        blk = key_block(torch.bfloat16)
        configs = [LatentConfig(64, blk, 8, 2), LatentConfig(64, blk, 4, 1), LatentConfig(64, blk, 8, 1, 2),
                   LatentConfig(64, blk, 4, 1, 4), LatentConfig(128, blk, 8, 1), LatentConfig(16, blk, 4, 2),
                   LatentConfig(16, blk, 8, 2), LatentConfig(32, blk, 4, 2), LatentConfig(16, blk, 4, 1, 2)]
        outs = [latent_attention_triton(q, k, dv, layout, d ** -0.5, cfg) for cfg in configs]
    else:
        configs = [AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 1), AttentionConfig(64, 64, 8, 2),
                   AttentionConfig(128, 64, 8, 2), AttentionConfig(128, 64, 4, 2), AttentionConfig(128, 64, 8, 3),
                   AttentionConfig(16, 64, 4, 3), AttentionConfig(16, 64, 4, 5), AttentionConfig(16, 64, 4, 2),
                   AttentionConfig(16, 64, 2, 2), AttentionConfig(16, 64, 4, 3, heads_fastest=True),
                   AttentionConfig(16, 64, 2, 3, heads_fastest=True),
                   AttentionConfig(32, 64, 4, 2), AttentionConfig(64, 64, 4, 2, heads_fastest=True)]
        if d > 192:  # head dim 256: the tiles whose stages fit in shared memory
            configs = [AttentionConfig(64, 64, 8, 2), AttentionConfig(64, 64, 8, 3), AttentionConfig(64, 64, 4, 2),
                       AttentionConfig(64, 64, 4, 1), AttentionConfig(128, 64, 8, 1), AttentionConfig(16, 64, 4, 2),
                       AttentionConfig(16, 64, 4, 2, heads_fastest=True), AttentionConfig(16, 64, 2, 1),
                       AttentionConfig(32, 64, 4, 2)]
        outs = [attention_triton(q, k, v, layout, d ** -0.5, cfg, **options) for cfg in configs]
    labels = [str(cfg) for cfg in configs]
    if not latent and kv_descriptors_fit(k, v):  # training's TMA loads of whole key blocks: the same bits again
        tma = [AttentionConfig(128, 64, 4, 2), AttentionConfig(128, 64, 4, 3), AttentionConfig(128, 64, 8, 2),
               AttentionConfig(64, 64, 4, 3), AttentionConfig(64, 64, 4, 4)]
        outs += [attention_triton(q, k, v, layout, d ** -0.5, cfg, kv_descriptors=True, **options) for cfg in tma]
        labels += [f"{cfg} with TMA K/V" for cfg in tma]
    for label, (out, lse) in zip(labels[1:], outs[1:]):
        tag = f"Hq={hq} Hkv={hkv} D={d} Dv={dv} window={window} sinks={sinks}"
        result.compare(out, outs[0][0], f"{tag} {label} vs {labels[0]}")
        result.compare(lse, outs[0][1], f"{tag} {label} lse")


def _paged_run(q, k, v, lens, steps, page_size, gen, value_in_key: bool = False, **options):
    """Feed sequences through the paged path; `steps(remaining)` yields per-sequence chunk sizes
    for one launch (0 = not in this launch). Returns outputs in packed order. With
    `value_in_key` (latent MLA: v is k's first dims) the V cache is a view of the K cache.
    `options`: `attention`'s `window` and `sinks`."""
    device = q.device
    hkv, d = k.shape[1], k.shape[2]
    pages = [-(-n // page_size) for n in lens]
    table_host = shuffled_block_table(lens, page_size, torch.Generator().manual_seed(gen.randrange(2 ** 31)))
    table = table_host.to(device)
    k_cache = torch.full((sum(pages), page_size, hkv, d), float("nan"), device=device, dtype=k.dtype)
    v_cache = k_cache[..., :v.shape[2]] if value_in_key else \
        torch.full((sum(pages), page_size, hkv, v.shape[2]), float("nan"), device=device, dtype=v.dtype)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    done = [0] * len(lens)
    while any(done[s] < lens[s] for s in range(len(lens))):
        chunks = steps([lens[s] - done[s] for s in range(len(lens))])
        idx, cu, seq_lens, rows, slots = [], [0], [], [], []
        for s, c in enumerate(chunks):
            if c <= 0:
                continue
            idx += range(starts[s] + done[s], starts[s] + done[s] + c)
            slots += slots_reference(table_host, s, torch.arange(done[s], done[s] + c), page_size).tolist()
            cu.append(cu[-1] + c)
            seq_lens.append(done[s] + c)
            rows.append(s)
            done[s] += c
        if not idx:  # a random schedule may pick no tokens for a step
            continue
        idx_t = torch.tensor(idx, device=device)
        kv_cache_write(k[idx_t], v[idx_t], k_cache, v_cache, torch.tensor(slots, device=device))
        layout = PagedLayout(torch.tensor(cu, dtype=torch.int32, device=device),
                             torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             table[rows].contiguous(), page_size, max(b - a for a, b in zip(cu, cu[1:])))
        out[idx_t] = attention(q[idx_t], k_cache, v_cache, layout, **options)
    return out


def check_attention(result: Result, hq: int, hkv: int, d: int, dv: int, lens: list[int], quick: bool,
                    window: int | None = None, sinks: bool = False) -> None:
    """Each query's output packed (training), each sequence packed alone and over shuffled pages
    in chunked prefill and decode schedules, bitwise; with a sliding `window` and random `sinks`."""
    gen = random.Random(hq * 1000 + d)
    t = sum(lens)
    q = torch.randn(t, hq, d, device="cuda").bfloat16()
    k = torch.randn(t, hkv, d, device="cuda").bfloat16()
    v = torch.randn(t, hkv, dv, device="cuda").bfloat16()
    options = dict(window=window, sinks=torch.randn(hq, device="cuda") if sinks else None)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    packed = attention_packed(q, k, v, cu, max(lens), **options)
    tag = f"Hq={hq} Hkv={hkv} D={d} Dv={dv} window={window} sinks={sinks} lens={lens}"
    # each sequence packed alone, and the sequences packed in reverse order
    for s in range(len(lens)):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        alone = attention_packed(q[sl], k[sl], v[sl], torch.tensor([0, lens[s]], dtype=torch.int32, device="cuda"), lens[s],
                                 **options)
        result.compare(alone, packed[sl], f"{tag} seq {s} packed alone")

    def fixed(c):
        return lambda rem: [min(c, r) for r in rem]

    def random_chunks(rem):
        return [min(r, gen.choice([0, 1, 1, 2, 5, 16, 37, 64, 200, 1000])) for r in rem]

    def prefill_then_decode(rem):  # prefill all but the last 48 tokens in one chunk, then decode
        return [r - 48 if r > 48 else min(r, 1) for r in rem]

    # pages of 64 (the engine's on Hopper): prompt chunks there run the Gluon prefill kernel
    schedules = [("chunk 128", fixed(128), 16), ("random chunks", random_chunks, 16),
                 ("random chunks", random_chunks, 64), ("prefill+decode", prefill_then_decode, 256)]
    if not quick:
        schedules += [("chunk 16", fixed(16), 256), ("chunk 1000", fixed(1000), 16)]
    for name, schedule, page_size in schedules:
        got = _paged_run(q, k, v, lens, schedule, page_size, gen, **options)
        result.compare(got, packed, f"{tag} {name} page {page_size}")


def check_latent_attention(result: Result, hq: int, rank: int, rope: int, lens: list[int], quick: bool) -> None:
    """The latent MLA kernel: each query's output packed (training), each sequence packed alone,
    and over a latent paged cache (V a view of K) in chunked prefill / decode schedules."""
    gen = random.Random(hq * 1000 + rank)
    t = sum(lens)
    q = torch.randn(t, hq, rank + rope, device="cuda").bfloat16()
    k = torch.randn(t, 1, rank + rope, device="cuda").bfloat16()
    v = k[..., :rank]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    packed = attention_packed(q, k, v, cu, max(lens))  # the default scale, as _paged_run's attention() calls
    tag = f"latent Hq={hq} D={rank}+{rope} Dv={rank} lens={lens}"
    for s in range(len(lens)):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        alone = attention_packed(q[sl], k[sl], k[sl][..., :rank], torch.tensor([0, lens[s]], dtype=torch.int32,
                                                                                device="cuda"), lens[s])
        result.compare(alone, packed[sl], f"{tag} seq {s} packed alone")

    def random_chunks(rem):
        return [min(r, gen.choice([0, 1, 1, 2, 5, 16, 37, 64, 200, 1000])) for r in rem]

    schedules = [("chunk 128", lambda rem: [min(128, r) for r in rem], 16), ("random chunks", random_chunks, 16),
                 ("prefill+decode", lambda rem: [r - 48 if r > 48 else min(r, 1) for r in rem], 64)]
    if not quick:
        schedules.append(("chunk 1000", lambda rem: [min(1000, r) for r in rem], 1))
    for name, schedule, page_size in schedules:
        got = _paged_run(q, k, v, lens, schedule, page_size, gen, value_in_key=True)
        result.compare(got, packed, f"{tag} {name} page {page_size}")


def check_latent_cache_write(result: Result, hq: int, rank: int, rope: int, nope: int, ms: list[int]) -> None:
    """The rollout's fused latent prologue (`kernels.latent_cache_write`: the latent's norm, the
    de-interleaved rope rotations, the query and key concatenations, the cache write): the queries
    and the cache of M tokens at once equal those of the separate ops training runs, and each
    token's equal the token's alone. The inputs are views of one projection's output, as in the
    model (q_proj's rows, then kv_a_proj_with_mqa's)."""
    m_max = max(ms)
    cos, sin = (t.cuda() for t in rope_table(1.0 / (1e4 ** (torch.arange(0, rope, 2) / rope)), 40960))
    proj = torch.randn(m_max, hq * (nope + rope) + rank + rope, device="cuda").bfloat16() * 3
    q, kv = proj.split([hq * (nope + rope), rank + rope], dim=1)
    q_pe = q.view(m_max, hq, nope + rope)[..., nope:]
    q_latent = torch.randn(m_max, hq, rank, device="cuda").bfloat16()
    weight = (torch.rand(rank, device="cuda") + 0.5).bfloat16()
    pos = torch.randint(0, 40960, (m_max,), device="cuda")
    slots = torch.randperm(m_max, device="cuda")
    tag = f"Hq={hq} {rank}+{rope}"
    for interleaved in (True, False):
        label = f"{tag} {'interleaved' if interleaved else 'NeoX'} rope"
        caches = [torch.zeros(m_max, 1, 1, rank + rope, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        args = (pos, cos, sin, weight, 1e-6)
        full = latent_cache_write(q_latent, q_pe, kv, *args, caches[0], slots, interleaved)
        want = latent_cache_write_reference(q_latent, q_pe, kv, *args, caches[1], slots, interleaved)
        result.compare(full, want, f"{label}: queries == separate ops, M={m_max}")
        result.compare(caches[0], caches[1], f"{label}: cache == separate ops, M={m_max}")
        for m in ms:
            alone = torch.zeros(m_max, 1, 1, rank + rope, device="cuda", dtype=torch.bfloat16)
            row = latent_cache_write(q_latent[m - 1:m], q_pe[m - 1:m], kv[m - 1:m], pos[m - 1:m], cos, sin, weight, 1e-6,
                                     alone, slots[m - 1:m], interleaved)
            result.compare(row, full[m - 1:m], f"{label}: token {m - 1} alone")
            s = slots[m - 1]
            result.compare(alone[s], caches[0][s], f"{label}: token {m - 1}'s cache row alone")


def attention_shape_names() -> list[str]:
    """The names of the attention and latent attention shapes the sweep checks, in its order."""
    return [s[0] for s in ATTENTION_SHAPES + LATENT_SHAPES]


def selected_shapes(text: str | None) -> set[str]:
    """The shape names of ``--shapes`` (comma-separated; None: every shape). Raises ValueError
    naming an unknown name and the known ones."""
    known = attention_shape_names()
    if text is None:
        return set(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--shapes: {text!r} names {', '.join(map(repr, unknown)) or 'no shape'}; "
                         f"the shapes are {', '.join(known)}")
    return set(names)


def sequence_lengths(quick: bool) -> list[int]:
    """The sequence lengths the attention and latent attention checks pack together."""
    return [1, 37, 300, 2048] if quick else [1, 37, 300, 2048, 8192]


def run_attention(result: Result, configs: Result | None, shape_names: set[str], quick: bool) -> None:
    """The attention check (and, given `configs`, the launch-config sweep) at each attention shape
    named in `shape_names`, under whichever attention forward is in use (FA4 takes no window or
    sinks: under it those shapes are left out, said so)."""
    for name, hq, hkv, d, dv, window, sinks in (s for s in ATTENTION_SHAPES if s[0] in shape_names):
        if (window is not None or sinks) and forward_mode() == "fa4":
            print(f"{result.name} {name}: left out (the fa4 forward takes no window or sinks)", flush=True)
            continue
        check_attention(result, hq, hkv, d, dv, sequence_lengths(quick), quick, window=window, sinks=sinks)
        if configs is not None:
            check_attention_configs(configs, hq, hkv, d, dv, latent=False, window=window, sinks=sinks)
        print(f"{result.name} {name}: {result.mismatches} mismatches so far", flush=True)
