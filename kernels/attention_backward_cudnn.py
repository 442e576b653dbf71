"""Backward of packed causal GQA attention on cuDNN's fused SDPA backward (docs/design.md rule 8).

Why: speed. The backward needs no invariance (docs/design.md rule 8), only correctness, so it
may be any correct kernel; the forward stays ours (rule 2). On the H200 cuDNN's backward runs
packed causal attention at D = 128 in 0.58-0.69x the time of torch's FlashAttention-2 backward
(`attention_backward_flash.py`), which is what SDPA's flash backend runs (`benchmarks/kernel_peers.py
--only attention`, H200, 2026-11-24). It is also what stock HF's sdpa attention runs in training on Hopper.

How it is called: through the cuDNN frontend's graph API (the optional ``nvidia-cudnn-frontend``
package, ``pip install 'vexact-models[cudnn]'``), not through torch's
``aten::_cudnn_attention_backward``: torch 2.11's varlen (nested) form of that op returned wrong
gradients on our packed layout (H200, torch 2.11, 2026-11-24). The graph describes the
packed ``[T, H, D]`` tensors as ragged ``[B, H, S, D]`` ones: each of q, k, v, out, dO, the LSE
and the gradients gets a ragged offset per sequence (``cu_seqlens * row stride``, in elements),
``seq_len_q = seq_len_kv`` the sequence lengths, a padding mask and a causal band
(``diagonal_band_right_bound = 0``, top-left aligned: every sequence has as many keys as queries).
The LSE it reads is the natural-log ``logsumexp`` of the scaled scores at ``[T, Hq]`` (stride 1
across heads): our forward's ``lse_log2 * ln 2``.

A batch of equal-length sequences (a single one included) is described densely instead, as
``[B, H, S, D]`` with no ragged offsets or padding mask, the way stock HF's sdpa hands its ``[B, S]``
batch to cuDNN (5-6% faster on the H200 at 1k-32k tokens per sequence, 2026-11-24).

Ragged graphs are built once per shape class and cached: the sequence count is rounded up to a power
of two (the extra sequences have length 0), the longest sequence to a power of two (at least 64),
and the token count, which sizes cuDNN's fp32 dQ accumulator in the workspace
(``max_total_seq_len``), to eighths of a power of two (`graph_dims`). A new shape class costs
~0.08 s on the H200 (1-2 s for the first, which compiles the kernel).

What it requires (`cudnn_backward_unavailable_reason`, in this order): the package, importable
with a cuDNN library it can load; q, k, v of one dtype, fp16 or bf16; every head dim a multiple
of 8 and at most 256 (q and k share one, v may differ, as in MLA's qk 192 / v 128); CUDA tensors
on one GPU; heads side by side in each row with 16-byte aligned rows (a fused projection's
views qualify; others are copied); and that cuDNN supports the graph on this GPU
(``check_support``, cached per shape class). Selection: `attention_backward_choice.py`.

Not proven: that cuDNN reads nothing past the last sequence's final tile. The tensors are passed at
their exact size (as torch's own nested cuDNN path passes them), and no run faulted, but a tile may
cover up to 127 rows beyond the last token.

Run to run: cuDNN accumulates dQ with atomics unless asked for its deterministic algorithm, which
this module does under ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

import torch

from ._triton import next_power_of_2

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
MAX_GRAPHS = 64  # shape classes kept per process (least recently used dropped)
LN2 = math.log(2.0)

# key -> (graph, workspace bytes, {name: graph tensor}, {row stride: offset tensor}), or cuDNN's error
_graphs: OrderedDict = OrderedDict()
_handles: dict[int, object] = {}


@functools.lru_cache(maxsize=None)
def _cudnn():
    """The cuDNN frontend module, or None when it is not installed or cannot load cuDNN (asked
    once per process: every layer's backward checks availability)."""
    try:
        import cudnn
        cudnn.backend_version()
    except (ImportError, OSError, RuntimeError):
        return None
    return cudnn


def graph_dims(num_seqs: int, max_seqlen: int, total_tokens: int) -> tuple[int, int, int]:
    """``(B, S, T)`` of the graph for a packed batch: sequences rounded up to a power of two,
    the longest sequence to a power of two >= 64, and the tokens to a multiple of 64 and of an
    eighth of their power of two, so that batches of similar shape share one graph."""
    tokens = max(total_tokens, 1)
    granule = max(64, next_power_of_2(tokens) // 8)
    return next_power_of_2(num_seqs), max(64, next_power_of_2(max_seqlen)), -(-tokens // granule) * granule


def _row_layout_ok(t: torch.Tensor) -> bool:
    """Heads side by side in each row (unit element stride, head stride = head dim) and rows
    16-byte aligned: the ragged layout the graph describes."""
    align = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.stride(1) == t.shape[-1] and t.stride(0) % align == 0
            and t.data_ptr() % 16 == 0)


def _static_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}: cuDNN's SDPA backward needs all of one of {DTYPES}"
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if d != dk:
        return f"head dims q={d}, k={dk}: cuDNN's SDPA needs one head dim for q and k"
    for name, dim in (("q/k", d), ("v", dv)):
        if dim % HEAD_DIM_MULTIPLE or dim > MAX_HEAD_DIM:
            return f"{name} head dim {dim}: cuDNN's SDPA backward needs a multiple of {HEAD_DIM_MULTIPLE} <= {MAX_HEAD_DIM}"
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return f"devices q={q.device}, k={k.device}, v={v.device}: the cuDNN backward needs CUDA tensors on one GPU"
    return None


def cudnn_backward_unavailable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 1,
                                      scale: float = 1.0) -> str | None:
    """Why cuDNN's SDPA backward cannot serve packed attention over q ``[T, Hq, D]``, k
    ``[T, Hkv, D]``, v ``[T, Hkv, Dv]``, or None when it can. With `cu_seqlens` it also builds
    (and caches) the graph for this shape class and reports cuDNN's refusal, if any."""
    if _cudnn() is None:
        return "the cuDNN frontend is not installed or cannot load cuDNN (pip install 'vexact-models[cudnn]')"
    reason = _static_reason(q, k, v)
    if reason is not None or cu_seqlens is None or q.shape[0] == 0:
        return reason
    entry = _graph(_graph_key(q, k, v, cu_seqlens.numel() - 1, max_seqlen, scale))
    return entry if isinstance(entry, str) else None


def cudnn_backward_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the package, dtypes, device and head dims allow `attention_backward_cudnn`
    (cuDNN may still refuse a shape: `cudnn_backward_unavailable_reason` with `cu_seqlens`)."""
    return cudnn_backward_unavailable_reason(q, k, v) is None


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if _row_layout_ok(t) else t.contiguous()


def _rows_stride(t: torch.Tensor) -> int:
    """The row stride `_contiguous_rows(t)` will have, without copying `t`."""
    return t.stride(0) if _row_layout_ok(t) else t.shape[1] * t.shape[2]


def _graph_key(q, k, v, num_seqs, max_seqlen, scale) -> tuple:
    """What a graph is built for: the shape (dense: `num_seqs` sequences of `max_seqlen` tokens
    each; else the ragged shape class of `graph_dims`), heads, head dims, the row strides of q,
    k, v as the graph reads them and of the contiguous out / dO, dtype, scale."""
    # Each length is <= max_seqlen, so tokens == num_seqs * max_seqlen means all are equal (no
    # device sync to find out): such a batch is described densely, as stock HF's sdpa describes
    # its [B, S] batch, without ragged offsets and padding mask
    dense = q.shape[0] == num_seqs * max_seqlen
    b, s, t = (num_seqs, max_seqlen, q.shape[0]) if dense else graph_dims(num_seqs, max_seqlen, q.shape[0])
    strides = tuple(_rows_stride(x) for x in (q, k, v)) + (q.shape[1] * v.shape[-1],)
    return (q.device.index, q.dtype, dense, b, s, t, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], strides,
            float(scale), torch.are_deterministic_algorithms_enabled())


def _handle(device_index: int):
    cudnn = _cudnn()
    if device_index not in _handles:
        with torch.cuda.device(device_index):
            _handles[device_index] = cudnn.create_handle()
    handle = _handles[device_index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device_index).cuda_stream)
    return handle


def _graph(key: tuple):
    """The built graph entry for `key` (LRU cached), or the error string cuDNN gave."""
    if key in _graphs:
        _graphs.move_to_end(key)
        return _graphs[key]
    try:
        entry = _build(key)
    except Exception as err:  # cuDNN's refusal (not supported here) is remembered, not retried
        entry = f"cuDNN cannot build this backward graph: {type(err).__name__}: {err}"
    _graphs[key] = entry
    if len(_graphs) > MAX_GRAPHS:
        _graphs.popitem(last=False)
    return entry


def _build(key: tuple):
    device_index, dtype, dense, b, s, t, hq, hk, d, dv, (q_rs, k_rs, v_rs, o_rs), scale, deterministic = key
    cudnn = _cudnn()
    io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
    f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle(device_index))

    def tensor(name, dim, stride, data_type=io):
        # uids are set after creation: older frontends (1.24) take no uid in graph.tensor
        return graph.tensor(name=name, dim=dim, stride=stride, data_type=data_type)

    def ragged(name, heads, dim, row_stride):
        return tensor(name, (b, heads, s, dim), (s * row_stride, dim, row_stride, 1))

    q, k, v = ragged("q", hq, d, q_rs), ragged("k", hk, d, k_rs), ragged("v", hk, dv, v_rs)
    o, do = ragged("o", hq, dv, o_rs), ragged("dO", hq, dv, o_rs)
    # cuDNN before 9.26 takes a non-ragged LSE only as packed [B, H, S] (`_execute` transposes it)
    stats = tensor("stats", (b, hq, s, 1), (hq * s, s, 1, 1) if dense else (s * hq, 1, hq, 1), f32)
    handles = {"q": q, "k": k, "v": v, "o": o, "dO": do, "stats": stats}
    padding = {}
    if not dense:
        handles["seq_len_q"], handles["seq_len_kv"] = (tensor(name, (b, 1, 1, 1), (1, 1, 1, 1), i32)
                                                       for name in ("seq_len_q", "seq_len_kv"))
        padding = dict(use_padding_mask=True, seq_len_q=handles["seq_len_q"], seq_len_kv=handles["seq_len_kv"],
                       max_total_seq_len_q=t, max_total_seq_len_kv=t)
    dq, dk, dv_ = graph.sdpa_backward(
        name="vexact_packed_attention_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=scale,
        diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        use_deterministic_algorithm=deterministic, **padding)
    for grad, heads, dim in ((dq, hq, d), (dk, hk, d), (dv_, hk, dv)):
        grad.set_output(True).set_dim((b, heads, s, dim)).set_stride((s * heads * dim, dim, heads * dim, 1))
    offsets: dict[int, object] = {}
    for ten, row_stride in ((q, q_rs), (k, k_rs), (v, v_rs), (o, o_rs), (do, o_rs), (stats, hq),
                            (dq, hq * d), (dk, hk * d), (dv_, hk * dv)):
        if dense:
            break
        if row_stride not in offsets:
            offsets[row_stride] = tensor(f"offsets_{row_stride}", (b + 1, 1, 1, 1), (1, 1, 1, 1), i64)
        ten.set_ragged_offset(offsets[row_stride])
    handles.update(dq=dq, dk=dk, dv=dv_)
    for uid, ten in enumerate([*handles.values(), *offsets.values()], start=1):
        ten.set_uid(uid)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, graph.get_workspace_size(), handles, offsets


def attention_backward_cudnn(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse_log2: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of packed causal GQA attention by cuDNN's SDPA backward.

    Args:
        grad_out: ``[T, Hq, Dv]`` gradient of the attention output, q's dtype.
        q, k, v: ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, Dv]`` of the forward (fp16/bf16, CUDA).
        out: ``[T, Hq, Dv]`` the forward's output (ours).
        lse_log2: ``[T, Hq]`` fp32, the forward's log2-sum-exp2 of the scaled scores (ours).
        cu_seqlens: ``[S+1]`` sequence offsets; max_seqlen: an upper bound on the sequence lengths.
        scale: the softmax scale the forward used.

    Raises ValueError naming the argument and the requirement for inputs it cannot take (shapes,
    dtypes, or a graph cuDNN refuses), before launching anything.
    """
    n_tokens, n_heads, _ = q.shape
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != (n_tokens, n_heads, v.shape[-1]) or t.dtype != q.dtype:
            raise ValueError(f"attention_backward_cudnn: {name} is {tuple(t.shape)} {t.dtype}, must be "
                             f"[{n_tokens}, {n_heads}, {v.shape[-1]}] {q.dtype}")
    if lse_log2.shape != (n_tokens, n_heads) or lse_log2.dtype != torch.float32:
        raise ValueError(f"attention_backward_cudnn: lse_log2 is {tuple(lse_log2.shape)} {lse_log2.dtype}, "
                         f"must be [{n_tokens}, {n_heads}] float32 (the forward's log2-sum-exp2)")
    if k.shape[0] != n_tokens or v.shape[0] != n_tokens or n_heads % k.shape[1] or v.shape[1] != k.shape[1]:
        raise ValueError(f"attention_backward_cudnn: k {tuple(k.shape)} / v {tuple(v.shape)} do not pack with "
                         f"q {tuple(q.shape)} (same tokens, query heads a multiple of KV heads)")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or max_seqlen < 1:
        raise ValueError(f"attention_backward_cudnn: cu_seqlens must be [S+1] with S >= 1 and max_seqlen >= 1, got "
                         f"{tuple(cu_seqlens.shape)} and {max_seqlen}")
    reason = cudnn_backward_unavailable_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"attention_backward_cudnn: {reason}")
    if n_tokens == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v = (_contiguous_rows(t) for t in (q, k, v))
    out, grad_out = out.contiguous(), grad_out.contiguous()
    entry = _graph(_graph_key(q, k, v, cu_seqlens.numel() - 1, max_seqlen, scale))
    if isinstance(entry, str):
        raise ValueError(f"attention_backward_cudnn: {entry}")
    return _execute(*entry, grad_out, q, k, v, out, lse_log2, cu_seqlens)


def _execute(graph, workspace_bytes, handles, offsets, grad_out, q, k, v, out, lse_log2, cu_seqlens):
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    values = {"q": q, "k": k, "v": v, "o": out, "dO": grad_out, "stats": lse_log2 * LN2, "dq": dq, "dk": dk, "dv": dv}
    if "seq_len_q" not in handles:  # dense: [B*S, H] -> [B, H, S]
        b, hq, s, _ = handles["stats"].get_dim()
        values["stats"] = values["stats"].view(b, s, hq).transpose(1, 2).contiguous()
    else:  # ragged
        b = handles["seq_len_q"].get_dim()[0]  # the graph's batch (the sequence count rounded up)
        starts = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if b > starts.numel() - 1:  # the rounded-up sequences are empty
            starts = torch.cat([starts, starts[-1:].expand(b + 1 - starts.numel())])
        values["seq_len_q"] = values["seq_len_kv"] = (starts[1:] - starts[:-1]).to(torch.int32)
    pack = {handles[name]: value for name, value in values.items()}
    for row_stride, ten in offsets.items():
        pack[ten] = starts * row_stride
    workspace = torch.empty(max(workspace_bytes, 1), device=q.device, dtype=torch.uint8)
    graph.execute(pack, workspace, handle=_handle(q.device.index))
    return dq, dk, dv
