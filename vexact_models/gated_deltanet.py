"""The gated-DeltaNet hybrids' layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; docs/design.md section
6b): the gated DeltaNet token mixer, the gated full attention, the hybrid decoder layer and the
MoE with a gated shared expert, each computed only with `vexact_models.kernels` ops. The
architecture folders subclass them under transformers' class names and module tree.

The training forward runs every op the rollout repeats (chunks at absolute positions, the same
conv, gates and norms); a rollout step runs them from the engine's per-sequence GDN state cache
(`runtime.linear_state_cache`), which the paged context carries.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn
from transformers import initialization as hf_init

from vexact_models.adapters import apply_linear
from vexact_models.kernels import (GATED_DELTA_CHUNK, causal_conv1d, gated_delta_gates, gated_delta_rule, gated_rms_norm,
                                   linear, sigmoid_gate, softmax_topk)
from vexact_models.experts import FusedExperts, call_experts
from vexact_models.layers import (GatedMLP, PackedContext, PreNormDecoderLayer, RMSNorm,
                                  ZeroCentredRMSNorm, grouped_linear, head_dim_of)
from vexact_models.patches.compat import gated_deltanet_a_log, gated_deltanet_a_log_init, qwen3_moe_router_output
from vexact_models.side_stream import beside


#: the hybrids' fp32 parity bound against stock's torch path (`Architecture.fp32_parity`; docs/design.md
#: section 6b), set by stock's own error: its fp32 logits are up to 1.2e-4 from float64 on a 20-token
#: sequence (ours 2.2e-5 there; ours vs stock 1.4e-4), 5.7e-5 at 37 tokens and 3.1e-4 at 150, ours
#: up to 4.9e-5, so ours vs stock can reach their sum, 3.6e-4 (2.2e-4 was met on a left-padded
#: 20-token row of the shared parity tests, 1.0e-5 on an 11-token hidden state). No fp32 implementation meets
#: the other architectures' 1e-5 at these random weights: with the delta rule exact an fp32 model is
#: still up to 5.4e-5 from float64. Ours is bounded against float64 instead, at 1e-4
#: (`tests/models/test_gated_deltanet_models.py`, 150 tokens: at most 4.9e-5 measured)
GDN_FP32_PARITY = 4e-4


def alternating_layer_types(layers: int) -> list[str]:
    """``layer_types`` of the tiny test configs: gated DeltaNet, gated attention, ... (a layer
    count given alone still makes a valid config)."""
    return [("linear_attention", "full_attention")[i % 2] for i in range(layers)]


def randomize_norms_and_gates(model: nn.Module, seed: int) -> None:
    """``Architecture.init_for_conformance`` of the hybrids: random values for what HF's init
    leaves constant (zero-centred norm weights at 0, gated norm weights and ``dt_bias`` at 1), so
    that parity and conformance exercise them. Works on stock transformers models too (by name)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                noise = torch.randn(param.shape, generator=generator) * 0.3
                param.copy_((param.detach().cpu().float() + noise).to(param.device, param.dtype))


def linear_chunk_size(config) -> int:
    """Rows of a delta-rule chunk (docs/design.md section 6b): 64, or the config's
    ``linear_chunk_size`` (a vexact-models field: tiny test configs take 16, so that short
    sequences cross chunk boundaries and the CPU reference stays fast), as a Python int. A
    ValueError unless it is an integer (numpy's too, not a bool) and a power of two >= 16."""
    size = getattr(config, "linear_chunk_size", None) or GATED_DELTA_CHUNK
    if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 16 or size & (size - 1):
        raise ValueError(f"{type(config).__name__}: linear_chunk_size={size!r} must be a power of two >= 16")
    return int(size)


class StockInitOrderMixin:
    """Mixed into the hybrids' ``PreTrainedModel`` (before `InitHookMixin`): every gated DeltaNet
    goes through ``_init_weights`` in ``from_pretrained``, loaded or not, as in stock.

    Stock's ``_init_weights`` draws ``A_log``'s U(0.01, 16) for each gated DeltaNet even when the
    checkpoint loaded it (and then leaves the loaded values). transformers skips modules of code
    outside transformers whose own tensors were all loaded (5.17 on), so ours would draw
    nothing there and a new head (``score``, a new ``lm_head``), initialised after the decoder,
    would get other values than stock's for the same seed (tests/models/test_hf_loading.py)."""

    def _initialize_weights(self, module: nn.Module, *args, **kwargs) -> None:
        if isinstance(module, GatedDeltaNet) and not getattr(module, "_is_hf_initialized", False):
            self._init_weights(module)
            module._is_hf_initialized = True
            return
        super()._initialize_weights(module, *args, **kwargs)


class GatedRMSNorm(nn.Module):
    """HF's ``RMSNormGated``: ``weight * rms_norm(x) * silu(gate)`` (`kernels.gated_rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.variance_epsilon)


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet token mixer (HF's ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``):
    projections, the causal conv1d (+ SiLU) over q/k/v, the gates, the gated delta rule, the
    gated RMSNorm and ``out_proj``. Subclasses create the input projections under the
    checkpoint's names and split them (`project`)."""

    norm_class: type[nn.Module] = GatedRMSNorm

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_v_heads, self.num_k_heads = config.linear_num_value_heads, config.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{type(config).__name__}: linear_num_value_heads={self.num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        if config.hidden_act != "silu":
            raise ValueError(f"{type(config).__name__}: hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.chunk_size = linear_chunk_size(config)
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, bias=False, kernel_size=self.conv_kernel_size,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(gated_deltanet_a_log(self.num_v_heads))
        self.norm = self.norm_class(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def init_random(self, std: float) -> None:
        """HF's init (called by `InitHookMixin`): ``dt_bias`` ones, ``A_log`` the log of U(0.01, 16)
        (U(0, 16) up to transformers 5.15: `patches.compat.gated_deltanet_a_log_init`), drawn as
        stock draws it: always, loaded or not, and then kept only where not loaded
        (transformers' ``initialization`` functions leave a loaded tensor alone), so the generator
        is where stock leaves it for the weights initialised after (`StockInitOrderMixin`)."""
        with torch.no_grad():
            hf_init.ones_(self.dt_bias)
            hf_init.copy_(self.A_log, gated_deltanet_a_log_init(self.A_log))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mixed_qkv [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])`` from the input projections."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, context) -> torch.Tensor:
        """Training (`PackedContext`: every sequence from position 0) or a rollout step (a paged
        context whose ``linear_states``, the engine's `runtime.linear_state_cache.LinearStep`,
        holds each sequence's conv and delta-rule state): the same ops, bitwise alike per token."""
        step = None if isinstance(context, PackedContext) else getattr(context, "linear_states", None)
        if step is None and not isinstance(context, PackedContext):
            raise NotImplementedError(f"{type(self).__name__} (layer {self.layer_idx}): a paged context without "
                                      "linear_states (the engine's GDN state cache, docs/design.md section 6b)")
        tokens = hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        weight = self.conv1d.weight[:, 0]
        if step is None:
            conv = causal_conv1d(mixed, weight, self.conv1d.bias, context.cu_seqlens, context.max_seqlen, "silu")
        else:
            conv = step.conv(self.layer_idx, mixed, weight, self.conv1d.bias, "silu")
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        if step is None:
            out, _ = gated_delta_rule(q, k, v, g, beta, context.cu_seqlens, chunk_size=self.chunk_size)
        else:
            out = step.delta_rule(self.layer_idx, q, k, v, g, beta)
        out = self.norm(out, z)
        return apply_linear(out.reshape(tokens, self.value_dim), self.out_proj)


class SplitProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layout: ``in_proj_qkv`` (q, k, v in conv channel order), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, one rollout GEMM group."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]]

    def project(self, hidden):
        mixed, z, b, a = grouped_linear(hidden, self.projection_groups()[0])
        return mixed, z.reshape(hidden.shape[0], self.num_v_heads, self.head_v_dim), b, a


class FusedProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layout: ``in_proj_qkvz`` and ``in_proj_ba``, grouped by key head (per key head:
    q, k, then its value heads' v and z; its value heads' b, then a), regrouped as HF's
    ``fix_query_key_value_ordering`` does (copies, no arithmetic)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.in_proj_qkvz, self.in_proj_ba]]

    def project(self, hidden):
        tokens, hk, per_k = hidden.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz, ba = grouped_linear(hidden, self.projection_groups()[0])
        q, k, v, z = qkvz.reshape(tokens, hk, -1).split(
            [self.head_k_dim, self.head_k_dim, per_k * self.head_v_dim, per_k * self.head_v_dim], dim=-1)
        b, a = ba.reshape(tokens, hk, 2 * per_k).split([per_k, per_k], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        return (mixed, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b.reshape(tokens, -1),
                a.reshape(tokens, -1))


class GatedAttention(nn.Module):
    """HF's ``Qwen3NextAttention`` / ``Qwen3_5Attention``: ``q_proj`` emits each head's query and
    output gate side by side, zero-centred q/k norms, (partial) rotary, attention, the output
    times ``sigmoid(gate)`` (`kernels.sigmoid_gate`, reading the gate in place), ``o_proj``."""

    norm_class: type[RMSNorm] = ZeroCentredRMSNorm

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = self.norm_class(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = self.norm_class(self.head_dim, eps=config.rms_norm_eps)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope, context) -> torch.Tensor:
        tokens = hidden.shape[0]
        qg, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q, gate = qg.view(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling, self.q_norm, self.k_norm)
        return apply_linear(sigmoid_gate(out, gate).reshape(tokens, -1), self.o_proj)


class HybridDecoderLayer(PreNormDecoderLayer):
    """A decoder layer whose token mixer is ``config.layer_types[layer_idx]``: a gated DeltaNet
    (``linear_attn``, a ``deltanet_class``) or gated full attention (``self_attn``, an
    ``attention_class``), then ``mlp`` (`make_mlp`) and the two ``norm_class`` norms, HF's module
    tree. Subclasses set the classes under transformers' names."""

    deltanet_class: type[GatedDeltaNet]
    attention_class: type[GatedAttention]
    norm_class: type[RMSNorm]

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = self.layer_kind(config, layer_idx)
        if self.layer_type == "linear_attention":
            self.linear_attn = self.deltanet_class(config, layer_idx)
        else:
            self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The layer's MLP (a SwiGLU MLP or an MoE block)."""
        raise NotImplementedError

    @staticmethod
    def layer_kind(config, layer_idx: int) -> str:
        kinds = getattr(config, "layer_types", None)
        kind = kinds[layer_idx] if kinds is not None and layer_idx < len(kinds) else None
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(f"{type(config).__name__}: layer_types[{layer_idx}]={kind!r}; each layer must be "
                             "'linear_attention' or 'full_attention'")
        return kind

    def mix(self, normed, positions, rope, context):
        if self.layer_type == "linear_attention":
            return self.linear_attn(normed, context)
        return self.self_attn(normed, positions, rope, context)


class SharedExpertRouter(nn.Module):
    """HF's ``TopKRouter`` of these models: logits in the model dtype, fp32 softmax, top-k, the
    top-k renormalised (always in Qwen3.5-MoE; ``norm_topk_prob`` in Qwen3-Next)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def init_random(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, hidden: torch.Tensor):
        logits = linear(hidden, self.weight)
        weights, ids = softmax_topk(logits, self.top_k, self.norm_topk_prob)
        return logits, weights, ids


class SharedExpertMoeBlock(nn.Module):
    """HF's ``SparseMoeBlock`` of these models: routed experts (`kernels.fused_moe`) plus a shared
    expert scaled per token by ``sigmoid(shared_expert_gate(x))`` (`kernels.sigmoid_gate`), added
    to the routed output inside the MoE kernel (bitwise ``experts + shared``, HF's order)."""

    routes = True  # takes the router-logits list (see PreNormDecoderLayer)

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = SharedExpertRouter(config)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def gated_shared_expert(self, hidden: torch.Tensor) -> torch.Tensor:
        """``shared_expert(x) * sigmoid(shared_expert_gate(x))`` per token."""
        return sigmoid_gate(self.shared_expert(hidden), apply_linear(hidden, self.shared_expert_gate))

    def forward(self, hidden: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        # in CUDA-graph captures without autograd the gated shared expert runs on a side stream
        # beside the router and the routed experts (`side_stream.beside`: the same kernels, the
        # same bits); the routed experts' combine waits for it
        shared, shared_ready = beside(self, hidden, call=self.gated_shared_expert)
        logits, weights, ids = self.gate(hidden)
        if router_logits is not None:
            router_logits.append(qwen3_moe_router_output(logits))
        return call_experts(self.experts, hidden, ids, weights, add=shared, add_ready=shared_ready)
