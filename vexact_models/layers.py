"""Building blocks shared by every architecture: the norm module, RoPE tables and the two
attention layouts of the one forward (packed for training, paged for inference); the
conversion of HF-style inputs (padded or packed) to the flat token batch is `flat_batch.py`.

The one-forward contract (docs/design.md section 3): a model's layers see a flat batch
``input_ids[T]``, ``positions[T]`` and an attention context. Training passes a
`PackedContext` (sequences back to back, causal within each); the runtime passes a
`PagedContext` (new tokens appended to a cached context in a paged KV cache). Both end in the
same attention kernel, so every token's hidden state is bitwise the same on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from vexact_models.kernels import (PagedLayout, add_rms_norm, apply_rotary, attention, attention_packed,
                                   gelu_tanh_and_mul,
                                   kv_cache_write, linear_silu_and_mul, rms_norm, rope_table, rotary_cache_write,
                                   silu_and_mul)

from .adapters import apply_linear
from .projections import (_fused_weight, fuse_linears, fuse_projections, fused_bias_free_weight,  # noqa: F401
                          grouped_linear)


def head_dim_of(config) -> int:
    """HF's rule: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``.

    Raises ValueError for a head_dim that is not a positive even int (RoPE rotates pairs of
    dims; HF's own ``head_dim or hidden // heads`` would silently turn 0 into hidden/heads) and,
    without head_dim, for hidden_size not a multiple of num_attention_heads (HF would floor it).
    """
    owner = type(config).__name__
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden, heads = config.hidden_size, config.num_attention_heads
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"{owner}: num_attention_heads={heads!r} must be an int >= 1")
        if hidden % heads:
            raise ValueError(f"{owner}: without head_dim, hidden_size={hidden} must be a multiple of "
                             f"num_attention_heads={heads}")
        head_dim = hidden // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"{owner}: head_dim={head_dim!r} must be an even int >= 2 (RoPE rotates pairs of dims)")
    return head_dim


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm (``weight``, ``variance_epsilon``) backed by `kernels.rms_norm`.

    Architectures subclass it under their HF name (e.g. ``Qwen3RMSNorm``) so that HF's weight
    initialisation recognises it. A subclass with ``zero_centred = True`` is the ``1 + weight``
    norm of Qwen3-Next and Qwen3.5 (weight stored as an offset from 1, initialised to zeros; the
    `kernels.rms_norm` option of that name).
    """

    zero_centred = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if self.zero_centred else torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with `residual`, ``(norm(x + residual), x + residual)`` in one kernel
        (`kernels.add_rms_norm`): the decoder layers carry the residual stream this way."""
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon, self.zero_centred)
        return add_rms_norm(x, residual, self.weight, self.variance_epsilon, self.zero_centred)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class ZeroCentredRMSNorm(RMSNorm):
    """HF's ``Qwen3NextRMSNorm`` / ``Qwen3_5RMSNorm`` / ``Gemma3RMSNorm``: ``norm(x) * (1 + weight)``,
    weight initialised to zeros."""

    zero_centred = True

    def init_random(self, std: float) -> None:
        """HF's init (called by `InitHookMixin`): zeros, i.e. a scale of 1."""
        nn.init.zeros_(self.weight)


def add_and_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, one kernel; before the first layer (`residual`
    None) `x` itself starts the residual stream."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class PreNormDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm decoder layer (``self_attn``, ``mlp``, ``input_layernorm``,
    ``post_attention_layernorm``, set by each architecture's subclass), called as
    ``layer(hidden, residual, positions, rope, context, router_logits=None) -> (mlp output,
    residual stream before it)``: each residual add is fused into the norm after it (see
    `DecoderModelMixin`). An MLP with ``routes = True`` (an MoE block) also gets the list that
    collects router logits. A transformers ``GradientCheckpointingLayer``: with checkpointing on,
    it runs under its model's checkpoint function (`vexact_models.checkpointing`)."""

    def mix(self, normed: torch.Tensor, positions, rope, context) -> torch.Tensor:
        """The token mixer's output: ``self_attn`` here; hybrid layers pick theirs (a gated
        DeltaNet's ``linear_attn``)."""
        return self.self_attn(normed, positions, rope, context)

    def forward(self, hidden, residual, positions, rope, context,
                router_logits: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = add_and_norm(self.input_layernorm, hidden, residual)
        normed, residual = self.post_attention_layernorm(self.mix(normed, positions, rope, context), residual)
        if getattr(self.mlp, "routes", False):
            return self.mlp(normed, router_logits), residual
        return self.mlp(normed), residual


#: the gated MLP's activations (HF's ``hidden_act``): SiLU (`kernels.silu_and_mul`) and Gemma's tanh
#: GeLU (`kernels.gelu_tanh_and_mul`), each ``act(gate) * up``
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    """HF's gated MLP (``gate_proj``, ``up_proj``, ``down_proj``; biased only with `bias`,
    e.g. Llama's ``mlp_bias``): ``down(act(gate(x)) * up(x))`` with `kernels.linear` and
    `kernels.silu_and_mul` (SiLU) or `kernels.gelu_tanh_and_mul` (Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: hidden_act={hidden_act!r} is not supported (one of "
                             f"{sorted(GATED_ACTIVATIONS)})")
        self.hidden_act = hidden_act
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.gate_proj, self.up_proj]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_bias_free_weight(x, [self.gate_proj, self.up_proj]) if self.hidden_act == "silu" else None
        if fused is not None:  # one launch where it can (rollout decode steps), the same bits
            return apply_linear(linear_silu_and_mul(x, fused), self.down_proj)
        gate, up = grouped_linear(x, [self.gate_proj, self.up_proj])
        # the op looked up at call time (benchmarks/stand_ins.py swaps this module's silu_and_mul)
        act = silu_and_mul if self.hidden_act == "silu" else gelu_tanh_and_mul
        return apply_linear(act(gate, up), self.down_proj)


class RopeTables:
    """One fp32 cos/sin table per model, indexed by absolute position (docs/design.md rule 5).

    Built on CPU from the config (HF's RoPE init functions, so YaRN & co. come for free) and
    copied to each device on first use; never a module buffer, so meta-device loading,
    ``state_dict`` and dtype casts cannot touch it. It covers ``max_position_embeddings`` and
    grows on demand (`ensure`) for longer inputs, as HF's rotary embedding accepts them: a row
    depends only on its position, so growing never changes an existing row. Tables replaced by
    growth stay referenced, since captured CUDA graphs may still read them.
    """

    def __init__(self, config, head_dim: int) -> None:
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):  # HF recomputes their frequencies from the batch's longest position
            raise ValueError(f"{type(config).__name__}: rope_parameters rope_type={rope_type!r} is not supported: its "
                             "frequencies depend on the batch's longest sequence, so no forward can be batch-invariant; "
                             "the static types (default, linear, llama3, yarn, ...) are supported")
        self.config = config
        self.head_dim = head_dim
        self.max_positions = int(config.max_position_embeddings)
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _build(self) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))
            # partial rotary (Qwen3-Next, Qwen3.5: 0.25): frequencies for the rotated dims only, as HF
            dim = int(self.head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, "cpu")
        return rope_table(inv_freq, self.max_positions, float(scaling))

    def ensure(self, positions: int) -> None:
        """Make the tables cover positions ``[0, positions)`` (doubling past the configured length)."""
        if positions <= self.max_positions:
            return
        while self.max_positions < positions:
            self.max_positions *= 2
        self._retired.extend(self._by_device.values())
        self._cpu, self._by_device = None, {}

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._by_device:
            if self._cpu is None:
                self._cpu = self._build()
            self._by_device[device] = tuple(t.to(device) for t in self._cpu)
        return self._by_device[device]


def rotate_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` queries and keys after the optional per-head norms (Qwen3's q_norm/k_norm,
    called as modules) and the rotary embedding at `positions`: the op sequence training runs."""
    cos, sin = rope
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, positions, cos, sin), apply_rotary(k, positions, cos, sin)


def plain_rms_norm(norm: nn.Module) -> bool:
    """Whether calling `norm` is `RMSNorm.forward` on its own weight: no override, no hooks."""
    return (isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward
            and not norm._forward_hooks and not norm._forward_pre_hooks)


def layer_window(config, layer_idx: int) -> int | None:
    """The sliding window of decoder layer `layer_idx` as transformers applies it, for the
    contexts' ``window=`` (docs/design.md section 3): ``config.sliding_window`` (None or absent:
    full attention) on the layers whose ``config.layer_types`` entry is ``"sliding_attention"``
    (Gemma 3, GPT-OSS, Qwen2/Qwen3 with ``use_sliding_window``), on every layer of a config
    without ``layer_types`` (Mistral). Raises ValueError for a window that is not an int >= 1 and
    for a layer type that is neither sliding nor full attention (e.g. Llama 4's chunked attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    kind = types[layer_idx] if types is not None else None
    if kind not in (None, "sliding_attention", "full_attention"):
        raise ValueError(f"{type(config).__name__}: layer_types[{layer_idx}]={kind!r} is not supported "
                         "(only 'sliding_attention' and 'full_attention')")
    if window is None or kind == "full_attention":
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{type(config).__name__}: sliding_window={window!r} must be None or an int >= 1")
    return window


def cache_window(model: nn.Module) -> int | None:
    """The window every attention layer of `model` stays within (the largest), or None when some
    layer attends to all its context or the model has no attention layer: the rollout engine
    frees the KV pages behind it (`runtime.block_manager`, docs/design.md section 6). Read from
    the modules, not the config, so that only a model that passes its windows is trusted with
    it: each decoder layer's ``self_attn`` declares the window it passes as ``sliding_window``
    (None, or no such attribute: full attention)."""
    windows = [getattr(m.self_attn, "sliding_window", None) for m in model.modules()
               if isinstance(getattr(m, "self_attn", None), nn.Module)]
    return None if not windows or None in windows else max(windows)


def window_layers(model: nn.Module) -> tuple[int, tuple[int, ...]] | None:
    """``(largest window, the windowed layers' indices)`` when `model` mixes windowed attention
    layers with full ones (Gemma 3, GPT-OSS), else None (no window, or every layer windowed: then
    `cache_window`): the rollout engine keeps the windowed layers' K/V in a page group of their
    own whose pages behind the window are freed (`runtime.page_groups`, docs/design.md section
    6). Read from the modules as `cache_window` does: each decoder layer's ``self_attn`` declares
    its window as ``sliding_window`` and its index as ``layer_idx``."""
    attns = [m.self_attn for m in model.modules() if isinstance(getattr(m, "self_attn", None), nn.Module)]
    windows = [getattr(attn, "sliding_window", None) for attn in attns]
    if None not in windows or all(w is None for w in windows):
        return None
    if not all(isinstance(getattr(attn, "layer_idx", None), int) for attn in attns):
        raise ValueError(f"{type(model).__name__}: its attention layers mix windows {sorted(set(map(str, windows)))} but "
                         "not every self_attn declares its decoder layer as an int `layer_idx` (the engine keeps the "
                         "windowed layers' pages apart by index)")
    windowed = tuple(sorted(attn.layer_idx for attn, w in zip(attns, windows) if w is not None))
    return max(w for w in windows if w is not None), windowed


class PackedContext:
    """Training layout: sequences packed back to back (``cu_seqlens``), causal within each.

    Every ``attend*`` method of both contexts takes a layer's `window` (None, or its
    ``sliding_window``: the query at position p sees keys p - window + 1 .. p) and `sinks` (None,
    or its ``[Hq]`` sink logits, GPT-OSS) per call; both sides run the same arithmetic
    (`kernels.attention_packed`, `kernels.attention`; docs/design.md section 3)."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = int(max_seqlen)

    def attend(self, layer_idx: int, q, k, v, scale: float, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the layer's ``[T, H, D]`` projections within each packed sequence
        (differentiable, `sinks` included)."""
        return attention_packed(q, k, v, self.cu_seqlens, self.max_seqlen, scale, window=window, sinks=sinks)

    def attend_rotary(self, layer_idx: int, q, k, v, positions, rope, scale: float,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`attend` after `rotate_qk`: the attention of the un-rotated projections."""
        q, k = rotate_qk(q, k, positions, rope, q_norm, k_norm)
        return self.attend(layer_idx, q, k, v, scale, window=window, sinks=sinks)


@dataclass
class WindowPages:
    """A step's second page group (docs/design.md section 6, `runtime.page_groups`): the layers
    `layers`, each attending within at most `window` keys, keep their K/V in caches of their own
    pages, addressed by `layout` (the step's sequences with their block tables in that group) and
    `slot_mapping` (where each new token's K/V go there)."""

    layout: PagedLayout
    slot_mapping: torch.Tensor
    layers: frozenset[int]
    window: int


@dataclass
class PagedContext:
    """Inference layout: each sequence's new tokens append to its cached context.

    ``kv_caches[layer]`` is ``(k_cache, v_cache)`` of shape ``[pages, page_size, Hkv, D]``;
    ``slot_mapping[T]`` says where each new token's K/V go. ``linear_states`` is the step's
    plan over the engine's gated-DeltaNet state cache (`runtime.linear_state_cache.LinearStep`),
    None for models without such layers (whose entries in ``kv_caches`` are None).
    ``window_pages``: the layers of a model mixing windowed and full attention that keep their
    pages in the window group read its layout and slots instead (`WindowPages`; None: one group).
    """

    layout: PagedLayout
    slot_mapping: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    linear_states: object | None = None
    window_pages: WindowPages | None = None

    def pages(self, layer_idx: int, window: int | None) -> tuple[PagedLayout, torch.Tensor]:
        """``(layout, slot_mapping)`` of the page group holding layer `layer_idx`'s K/V. Raises
        ValueError for a window-group layer attending beyond the group's window (its pages behind
        the window are freed)."""
        group = self.window_pages
        if group is None or layer_idx not in group.layers:
            return self.layout, self.slot_mapping
        if window is None or window > group.window:
            raise ValueError(f"PagedContext: layer {layer_idx} keeps its K/V in the window group, whose pages behind "
                             f"{group.window} keys are freed, but attends with window={window!r}")
        return group.layout, group.slot_mapping

    def attend(self, layer_idx: int, q, k, v, scale: float, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K/V into the layer's cache, then attend over it (`PackedContext`'s
        `window` and `sinks`)."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        kv_cache_write(k, v, k_cache, v_cache, self.pages(layer_idx, window)[1])
        return self.attend_cache(layer_idx, q, scale, window=window, sinks=sinks)

    def attend_cache(self, layer_idx: int, q, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `q` over the layer's cache as it stands: for ops that wrote this step's
        keys and values themselves (`kernels.latent_cache_write`)."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        return attention(q, k_cache, v_cache, self.pages(layer_idx, window)[0], scale, window=window, sinks=sinks)

    def attend_rotary(self, layer_idx: int, q, k, v, positions, rope, scale: float,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`PackedContext.attend_rotary`'s result, with the norms, rotations and cache write in
        one kernel (`kernels.rotary_cache_write`, bitwise the separate ops) where the modules are
        plain RMSNorms of one epsilon; otherwise the separate ops, module calls included."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        if q_norm is not None and not (plain_rms_norm(q_norm) and plain_rms_norm(k_norm)
                                       and q_norm.variance_epsilon == k_norm.variance_epsilon
                                       and q_norm.zero_centred == k_norm.zero_centred):
            q, k = rotate_qk(q, k, positions, rope, q_norm, k_norm)
            return self.attend(layer_idx, q, k, v, scale, window=window, sinks=sinks)
        cos, sin = rope
        weights = (q_norm.weight, k_norm.weight, q_norm.variance_epsilon) if q_norm is not None else (None, None, 1e-6)
        zero_centred = q_norm is not None and q_norm.zero_centred
        q = rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, self.pages(layer_idx, window)[1],
                               *weights, zero_centred=zero_centred)
        return self.attend_cache(layer_idx, q, scale, window=window, sinks=sinks)
