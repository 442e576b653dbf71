"""Checkpoint-name mapping: let our classes load every checkpoint layout stock HF loads.

transformers converts some published layouts at load time (e.g. Qwen3-MoE and DeepSeek-V3 hub
checkpoints store one tensor per expert, ``mlp.experts.<e>.gate_proj.weight``..., which it fuses
into ``mlp.experts.gate_up_proj [E, 2I, H]``) and reverses the conversion on save. It applies
those conversions only to its own classes, or to model types registered by the user; so we
register HF's own mapping for the model types we serve. Stock classes are unaffected.
"""

from __future__ import annotations


def enable_checkpoint_conversions(model_type: str) -> bool:
    """Apply transformers' own weight conversions for `model_type` to our classes too.

    Returns False when this transformers version has no conversion registry (then only the
    layout of its own modeling code loads). Idempotent.
    """
    try:
        from transformers.conversion_mapping import (USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:
        return False
    if model_type in USER_REGISTERED_MAPPINGS:
        return True
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is None:
        return False
    register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
    return True
