"""VeOmni (ByteDance Seed's trainer, PyPI ``veomni``) builds and FSDP2-shards our training variants.

    from vexact_models.integrations import veomni as vexact_veomni
    vexact_veomni.shim_transformers()      # before `import veomni` on transformers > 5.10
    vexact_veomni.register()               # VeOmni's MODELING_REGISTRY now returns our classes
    model = veomni.models.build_foundation_model(...)   # our class; build_parallelize_model shards it

VeOmni looks model classes up in ``veomni.models.loader.MODELING_REGISTRY`` (model_type ->
``fn(architecture name) -> class``). Use ``MixedPrecisionConfig(cast_forward_inputs=False)``:
VeOmni's default input cast rounds the layers' fp32 RoPE tables (docs/fsdp.md).
`examples/veomni_fsdp2.py` shows the sharded logprobs equal to an `LLM` rollout, bitwise.
"""

from __future__ import annotations

import importlib

_GONE_IN_NEW_TRANSFORMERS = [
    ("qwen2_5_omni", "Qwen2_5OmniThinkerCausalLMOutputWithPast"), ("qwen2_5_vl", "Qwen2_5_VLCausalLMOutputWithPast"),
    ("qwen2_vl", "Qwen2VLCausalLMOutputWithPast"), ("qwen3_omni_moe", "Qwen3OmniMoeThinkerCausalLMOutputWithPast"),
    ("qwen3_vl", "Qwen3VLCausalLMOutputWithPast"), ("qwen3_vl_moe", "Qwen3VLMoeCausalLMOutputWithPast"),
]


def shim_transformers() -> list[str]:
    """Alias the output classes veomni 0.1.12 imports at module level and newer transformers no
    longer have (used only by VeOmni's multimodal models). Returns what was aliased."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    aliased = []
    for model, name in _GONE_IN_NEW_TRANSFORMERS:
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        if not hasattr(module, name):
            setattr(module, name, CausalLMOutputWithPast)
            aliased.append(name)
    return aliased


# VeOmni reads checkpoints itself (into the FSDP shards) and fuses the hub's per-expert tensors
# into [E, 2I, H] / [E, H, I] through a converter its own MoE classes carry: exactly our layout.
# Qwen3-Next's and Qwen3.5-MoE's per-expert keys (as transformers before 5.11 saves them) are
# Qwen3-MoE's, and VeOmni carries no converter of their own: its Qwen3-MoE converter fuses them;
# GLM-4.5's are DeepSeek-V3's (its dense first layers included): DeepSeek-V3's converter fuses them.
_VEOMNI_CONVERTERS = {
    "qwen3_moe": ("veomni.models.transformers.qwen3_moe.checkpoint_tensor_converter", "qwen3_moe"),
    "qwen3_next": ("veomni.models.transformers.qwen3_moe.checkpoint_tensor_converter", "qwen3_moe"),
    "qwen3_5_moe_text": ("veomni.models.transformers.qwen3_moe.checkpoint_tensor_converter", "qwen3_moe"),
    "deepseek_v3": ("veomni.models.transformers.deepseek_v3.checkpoint_tensor_converter", "deepseek_v3"),
    "glm4_moe": ("veomni.models.transformers.deepseek_v3.checkpoint_tensor_converter", "deepseek_v3"),
}


def register() -> list[str]:
    """Make VeOmni build our training variants for every model_type we serve (and read MoE
    checkpoints with its expert-fusing converters)."""
    from veomni.models.loader import MODELING_REGISTRY

    from vexact_models.registry import architectures

    names = []
    for arch in architectures():
        for model_type in arch.model_types:
            if model_type in _VEOMNI_CONVERTERS:
                module, stem = _VEOMNI_CONVERTERS[model_type]
                converters = importlib.import_module(module)
                cls = arch.causal_lm_class
                cls._create_checkpoint_tensor_converter = staticmethod(
                    getattr(converters, f"create_{stem}_checkpoint_tensor_converter"))
                cls._convert_fqn_to_index_mapping = staticmethod(
                    getattr(converters, f"convert_{stem}_fqn_to_index_mapping"))
            # a local override: VeOmni ships its own qwen3 / qwen3_moe / deepseek_v3 entries
            MODELING_REGISTRY[model_type] = lambda architecture, cls=arch.causal_lm_class: cls
            names.append(model_type)
    return names


def eager_ops():
    from veomni.arguments.arguments_types import OpsImplementationConfig

    fields = ("moe", "cross_entropy_loss", "rms_norm", "swiglu_mlp", "rotary_pos_emb", "rotary_pos_emb_vision",
              "load_balancing_loss", "rms_norm_gated", "causal_conv1d", "chunk_gated_delta_rule")
    return OpsImplementationConfig(attn_implementation="eager", **{f"{f}_implementation": "eager" for f in fields})
