"""What differs between the transformers releases we support (5.2.0 to 5.23.0), in one place.

Each shim says which releases it is for and why. CI runs the ``compat`` tests on the oldest
supported release, on 5.10.x (verl 0.9.1's ceiling), on 5.17 (inside the 5.13-5.18 range that
needs `route`) and on the newest (see ``.ci/run``).

- `route` / `routed_class` / `unroute`: the Auto-class mappings (``_LazyAutoMapping``).
- `HFCompatMixin`: ``attn_implementation`` / ``experts_implementation`` for our models.
- `qwen3_moe_router_output`: what Qwen3-MoE reports as ``router_logits``.
- `register_conversion`: transformers' checkpoint conversions (hub layouts) for our classes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)
MISSING = object()
logger = logging.getLogger("vexact_models")


# --- Auto-class mappings ---------------------------------------------------------------------
# Every release from 5.2 to 5.23 resolves ``AutoModel*`` through ``_LazyAutoMapping.__getitem__`` /
# ``__contains__``, which consult the mapping's ``_extra_content`` dict before transformers' own
# table. Its public ``register()`` writes that dict, except on 5.13.0 to 5.18.x, where it returns
# without writing when the config class comes from transformers itself (``Qwen3Config``...),
# whatever ``exist_ok`` says (5.19 made it honour ``exist_ok=True`` again). So `patch()` writes the
# dict directly: the one mechanism every release reads.

def route(mapping, config_class: type, model_class: type) -> object:
    """Make `mapping` (e.g. ``MODEL_FOR_CAUSAL_LM_MAPPING``) resolve `config_class` to
    `model_class`. Returns what it resolved to through ``_extra_content`` before (or `MISSING`)."""
    previous = mapping._extra_content.get(config_class, MISSING)
    mapping._extra_content[config_class] = model_class
    return previous


def unroute(mapping, config_class: type, previous: object) -> None:
    """Undo `route`: restore `previous` (`MISSING`: transformers' own class again)."""
    if previous is MISSING:
        mapping._extra_content.pop(config_class, None)
    else:
        mapping._extra_content[config_class] = previous


def routed_class(mapping, config_class: type) -> type | None:
    """The class `mapping` gives for `config_class`, by the lookup ``AutoModel*`` performs."""
    try:
        return mapping[config_class]
    except KeyError:
        return None


# --- attn_implementation / experts_implementation --------------------------------------------
# HF's PreTrainedModel.__init__ validates ``config._attn_implementation`` against the class's
# ``_supports_sdpa`` / ``_supports_flash_attn`` / ``_supports_flex_attn`` flags and the installed
# packages (flash_attn, the hub ``kernels``), and ``_experts_implementation`` against a look at
# the class's source for ``@use_experts_implementation``. Our models run the aligned attention
# and MoE kernels whatever is requested, so `HFCompatMixin` accepts every value HF knows and
# records it where HF code reads it. Signatures differ between releases (5.5 added
# ``allow_all_kernels``), hence ``*args, **kwargs``.

_logged_attn = False
# configs whose attn_implementation we defaulted (None -> "sdpa"), by id: an outer model's
# __init__ stores "sdpa" on the config its inner model then sees, which was not requested
_defaulted_configs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def valid_attn_implementations() -> set[str]:
    """The ``attn_implementation`` names this transformers knows (hub kernels aside): ``eager``
    plus its attention registry (5.2: sdpa, flash_attention_2/3, flex_attention, paged|...;
    5.10+ adds flash_attention_4)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}


def valid_experts_implementations() -> set[str]:
    """The ``experts_implementation`` names this transformers knows: ``eager`` plus its experts
    registries (5.2: grouped_mm, batched_mm; later deepgemm, sonicmoe, the FP8 ones)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    names = {"eager", *ALL_EXPERTS_FUNCTIONS.keys()}
    try:  # 5.4+ (HF's own check accepts these from 5.7); 5.2-5.6 import triton in that module
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        names |= set(ALL_FP8_EXPERTS_FUNCTIONS.keys())
    except ImportError:
        pass
    return names


def resolve_attn_implementation(requested: str | None, model_name: str) -> str:
    """What HF stores in ``config._attn_implementation`` for `requested` on a model that supports
    every implementation: the requested name, or ``"sdpa"`` (HF's default) for None. A ``paged|``
    prefix HF dropped (5.23 accepts ``paged|sdpa`` and stores ``sdpa``) is dropped too. Unknown
    names are a ValueError, as in HF."""
    if requested is None:
        return "sdpa"
    from transformers.integrations.hub_kernels import is_kernel

    valid = valid_attn_implementations()
    if requested.startswith("paged|") and requested not in valid and requested.removeprefix("paged|") in valid:
        requested = requested.removeprefix("paged|")
    if requested not in valid and not is_kernel(requested):
        raise ValueError(f"{model_name}: attn_implementation={requested!r} is not one transformers "
                         f"{transformers.__version__} knows; use one of {sorted(valid)} or a hub kernel "
                         "'org/repo[@revision][:name]'")
    return requested


def note_attn_implementation(config, requested: str | None, resolved: str) -> None:
    """Say once per process (a warning on the ``vexact_models`` logger) that a requested
    attention implementation is not what runs. Defaults are not requests."""
    global _logged_attn
    if requested is None:
        _defaulted_configs[id(config)] = config
        return
    if _logged_attn or (requested == "sdpa" and _defaulted_configs.get(id(config)) is config):
        return
    _logged_attn = True
    logger.warning("vexact-models: attn_implementation=%r requested; the aligned attention kernel runs instead "
                   "(bitwise equal to rollouts)", resolved)


def resolve_experts_implementation(requested: str | None, model_name: str) -> str:
    """What HF stores in ``config._experts_implementation`` for `requested`: the requested name,
    or ``"eager"`` for None (HF's choice for a class that does not dispatch its experts through
    HF's registry). Unknown names are a ValueError, as in HF."""
    if requested is None:
        return "eager"
    valid = valid_experts_implementations()
    if requested not in valid:
        raise ValueError(f"{model_name}: experts_implementation={requested!r} is not one transformers "
                         f"{transformers.__version__} knows; use one of {sorted(valid)}")
    return requested


class HFCompatMixin:
    """Mixed into our ``PreTrainedModel`` classes (before ``PreTrainedModel``): every
    ``attn_implementation`` HF accepts loads (``eager``, ``sdpa``, ``flash_attention_2/3/4``,
    ``flex_attention``, hub kernels such as ``kernels-community/flash-attn``, None), even
    without flash-attn or ``kernels`` installed, and reads back from ``config._attn_implementation``
    as HF stores it; the aligned attention runs regardless and says so once per process (a
    ``logging`` warning on the ``vexact_models`` logger). Likewise every ``experts_implementation``
    (HF's heads and trainers pass e.g. ``grouped_mm``) is accepted; the aligned MoE kernel runs."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        resolved = resolve_attn_implementation(attn_implementation, type(self).__name__)
        note_attn_implementation(self.config, attn_implementation, resolved)
        return resolved

    def get_correct_attn_implementation(self, requested_attention: str | None, *args, **kwargs) -> str:
        resolved = resolve_attn_implementation(requested_attention, type(self).__name__)
        note_attn_implementation(self.config, requested_attention, resolved)
        return resolved

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None, *args, **kwargs) -> str:
        return resolve_experts_implementation(experts_implementation, type(self).__name__)

    def get_correct_experts_implementation(self, requested_experts: str | None, *args, **kwargs) -> str:
        return resolve_experts_implementation(requested_experts, type(self).__name__)

    # HF decides these by reading the class's module source for its attention / experts
    # interfaces; ours accept any value, so `set_attn_implementation` / `set_experts_implementation`
    # may record it
    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True


# --- Qwen3-MoE router_logits --------------------------------------------------------------------
# Up to 5.5.x, HF's Qwen3MoeTopKRouter returned the fp32 softmax probabilities under the name
# ``router_logits`` (and ``load_balancing_loss_func`` softmaxes them once more); 5.6.0 returns
# the raw logits. ``output_router_logits`` and the auxiliary loss follow the installed release,
# so that a drop-in gives stock HF's numbers. Routing itself never depends on this.
_QWEN3_MOE_ROUTER_RETURNS_PROBS = TRANSFORMERS_VERSION < Version("5.6.0")


def qwen3_moe_router_output(logits: torch.Tensor) -> torch.Tensor:
    """What stock Qwen3-MoE reports as one layer's ``router_logits`` on this transformers."""
    return torch.softmax(logits, dim=-1, dtype=torch.float32) if _QWEN3_MOE_ROUTER_RETURNS_PROBS else logits


# --- checkpoint conversions --------------------------------------------------------------------
# transformers converts some published checkpoint layouts at load time and back on save (hub MoE
# checkpoints store one tensor per expert; the models hold fused 3-D experts), through a table
# keyed by model_type or class name (``transformers.conversion_mapping``). Up to 5.12.x it applies
# the table to every class by its config's model_type, ours included. From 5.13 it skips classes
# defined outside transformers ("custom code", which ours are) unless their model_type or class
# name is in ``USER_REGISTERED_MAPPINGS``, which ``register_checkpoint_conversion_mapping`` fills.
# So on 5.13+ our model types must be registered, and before there is nothing to do.

def register_conversion(model_type: str) -> Callable[[], None] | None:
    """Make transformers apply its own checkpoint conversion for `model_type` to classes defined
    outside transformers too. Returns a function that undoes exactly this registration (the
    table entry and ``USER_REGISTERED_MAPPINGS`` as they were), or None when nothing changed:
    before 5.13 (the conversion applies anyway), when transformers has no conversion for
    `model_type`, or when it is registered already (by `patch()`, an enclosing load or the user;
    theirs stays)."""
    from transformers import conversion_mapping as table

    registered = getattr(table, "USER_REGISTERED_MAPPINGS", None)
    if registered is None or model_type in registered:
        return None
    mapping = table.get_checkpoint_conversion_mapping(model_type)  # a copy; builds the table on first use
    if mapping is None:
        return None
    previous = table._checkpoint_conversion_mapping_cache[model_type]
    table.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)

    def undo() -> None:
        registered.discard(model_type)
        table._checkpoint_conversion_mapping_cache[model_type] = previous

    return undo
