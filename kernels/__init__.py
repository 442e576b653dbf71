"""Aligned ops: batch-invariant kernels with a Triton (GPU) and a reference (CPU) backend.

Each op lives in its own module with its Triton kernel, launcher, reference implementation,
backward (where training needs one) and a docstring stating its invariance contract. Model code
imports ops from this package only, never from its modules (tests/kernels/test_public_names.py
checks it); a name imported across files (benchmarks, GPU proofs) is public in its module.
"""

from .hub_shadow import hand_over

if __name__ == "kernels" and hand_over(__name__, __file__):
    pass  # imported as the top-level ``kernels`` beside Hugging Face's distribution of that name: that one serves
else:
    from .attention import PagedLayout, attention, packed_layout
    from .attention_forward_choice import forward_mode as attention_forward_mode
    from .attention_forward_choice import set_attention_forward, use_attention_forward
    from .attention_backward_choice import set_attention_backward, use_attention_backward
    from .attention_packed import attention_packed
    from .backend import BACKENDS, UnsupportedError, current_backend, set_backend, use_backend
    from .causal_conv1d import causal_conv1d, conv_state_update
    from .dependent_launch import set_dependent_launch, use_dependent_launch
    from .gated_delta_backward import use_gated_delta_backward
    from .gated_delta_gates import gated_delta_gates
    from .gated_delta_rollout import GatedDeltaRollout
    from .gated_delta_rule import CHUNK as GATED_DELTA_CHUNK
    from .gated_delta_rule import gated_delta_rule
    from .gated_rms_norm import gated_rms_norm
    from .grouped_topk import sigmoid_grouped_topk
    from .head_linear import head_linear
    from .kernel_switch import KernelSwitch
    from .kv_cache_write import kv_cache_write
    from .latent_cache_write import latent_cache_write
    from .linear import linear
    from .linear_quack import linear_mode as linear_backend_mode
    from .linear_quack import set_linear_backend, use_linear_backend
    from .linear_silu_and_mul import linear_silu_and_mul
    from .log_softmax import gather_logprobs, log_softmax
    from .logit_softcap import logit_softcap
    from .gelu_tanh_and_mul import gelu_tanh_and_mul
    from .lora import lora_add, lora_partials
    from .moe_backward import use_moe_backward
    from .moe import fused_moe
    from .moe_activation import SwigluClamp
    from .expert_lora import EXPERT_B, ExpertLora, KeptExpertB, reading_kept_b
    from .moe_routing import softmax_topk
    from .penalties import apply_penalties
    from .rms_norm import add_rms_norm, rms_norm
    from .rotary import apply_rotary, deinterleave, rope_table
    from .rotary_cache_write import rotary_cache_write
    from .saved_by_checkpointing import checkpoint_saving_context
    from .sampling import sample_tokens
    from .sigmoid_gate import sigmoid_gate
    from .silu_and_mul import silu_and_mul
    from .streams import LORA_SHRINK, begin_beside, forks_here, side_stream
    from .token_logprobs import lm_head_logits, token_logprobs
    from .top_tokens import top_tokens

    __all__ = [
        "BACKENDS", "GATED_DELTA_CHUNK", "GatedDeltaRollout", "LORA_SHRINK", "begin_beside", "forks_here", "side_stream",
        "KernelSwitch", "PagedLayout", "UnsupportedError", "add_rms_norm", "apply_rotary", "attention",
        "attention_forward_mode", "attention_packed", "causal_conv1d", "checkpoint_saving_context", "conv_state_update",
        "current_backend", "deinterleave", "EXPERT_B", "ExpertLora", "KeptExpertB", "reading_kept_b",
        "SwigluClamp", "apply_penalties", "fused_moe", "gelu_tanh_and_mul", "gated_delta_gates",
        "gated_delta_rule",
        "gated_rms_norm", "gather_logprobs", "head_linear", "kv_cache_write", "latent_cache_write", "linear",
        "linear_backend_mode", "linear_silu_and_mul", "lm_head_logits", "log_softmax", "logit_softcap", "lora_add",
        "lora_partials",
        "packed_layout", "rms_norm", "rope_table",
        "rotary_cache_write",
        "sample_tokens", "top_tokens", "set_attention_backward", "set_attention_forward", "set_backend", "set_dependent_launch",
        "set_linear_backend", "sigmoid_gate", "sigmoid_grouped_topk", "silu_and_mul", "softmax_topk", "token_logprobs",
        "use_attention_backward", "use_attention_forward", "use_backend", "use_dependent_launch",
        "use_gated_delta_backward", "use_linear_backend", "use_moe_backward",
    ]
