"""What differs between the transformers releases we support (5.2.0 to 5.24.0), in one place.

Each shim says which releases it is for and why. CI runs the ``compat`` tests on the oldest
supported release, on 5.10.x (verl 0.9.1's ceiling), on 5.17 (inside the 5.13-5.18 range that
needs `route`) and on the newest (see ``.ci/run``).

- `route` / `routed_class` / `unroute` / `configs_given_the_same_class`: the Auto-class mappings
  (``_LazyAutoMapping``).
- `transformers_namespaces`: the ``transformers`` module objects a process holds (two, not one).
- `HFCompatMixin`: ``attn_implementation`` / ``experts_implementation`` for our models.
- `qwen3_moe_router_output`: what Qwen3-MoE reports as ``router_logits``.
- `select_hidden_states`: ``output_hidden_states`` given as layer indices.
- `register_conversion`: transformers' checkpoint conversions (hub layouts) for our classes.
- `gated_deltanet_a_log_init`: the gated DeltaNet's ``A_log`` init (Qwen3.5, Qwen3-Next).
"""

from __future__ import annotations

import logging
import sys
import types
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


def configs_given_the_same_class(mapping, config_class: type) -> list[type]:
    """The other config classes for which `mapping` gives, by transformers' own name table, the
    class it gives `config_class` (Qwen3.5's multimodal ``Qwen3_5Config``: ``AutoModelForCausalLM``
    of a published multimodal checkpoint builds the text ``Qwen3_5ForCausalLM``, on every release
    from 5.2). Read from the name tables; only config classes are imported."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    table = mapping._model_mapping  # model_type -> class name (a tuple of names for a few types)
    name = table.get(config_class.model_type)
    return [CONFIG_MAPPING[model_type] for model_type, other in table.items()
            if other == name and name is not None and model_type != config_class.model_type
            and model_type in CONFIG_MAPPING]


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


# --- the transformers namespace -------------------------------------------------------------
# transformers' processing_utils (imported with any model's modeling code) runs
# ``direct_transformers_import``, which executes transformers/__init__.py again and so puts a new
# lazy module in ``sys.modules["transformers"]`` (5.2 to 5.25). Modules that ran ``import
# transformers`` before that keep the first object, ours or TRL's trainers depending on import
# order, and a name set on one object is not seen through the other.

def transformers_namespaces() -> list[types.ModuleType]:
    """Every ``transformers`` module object of this process: ``sys.modules["transformers"]``
    and any other that a loaded module holds as a global (each once)."""
    current = sys.modules["transformers"]
    found = {id(current): current}
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            # type(), not isinstance(): the latter reads __class__, which some lazy globals warn on
            if issubclass(type(value), types.ModuleType) and value.__name__ == "transformers":
                found.setdefault(id(value), value)
    return list(found.values())


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


def resolve_experts_implementation(requested: str | None, model_name: str, routed: bool = True) -> str:
    """What HF stores in ``config._experts_implementation`` for `requested`: the requested name,
    or ``"eager"`` for None (HF's choice for a class that does not dispatch its experts through
    HF's registry). Unknown names are a ValueError, as in HF; so is any name but ``"eager"`` for
    a model without routed experts (not `routed`: HF's dense classes refuse ``grouped_mm``)."""
    if requested is None:
        return "eager"
    valid = valid_experts_implementations()
    if requested not in valid:
        raise ValueError(f"{model_name}: experts_implementation={requested!r} is not one transformers "
                         f"{transformers.__version__} knows; use one of {sorted(valid)}")
    if not routed and requested != "eager":
        raise ValueError(f"{model_name}: experts_implementation={requested!r} cannot be honoured: the model has no "
                         "routed experts (leave it unset, or 'eager')")
    return requested


def has_routed_experts(model_class: type) -> bool:
    """Whether `model_class`'s module defines a routed-experts block (a class with ``routes =
    True``, the marker `layers.PreNormDecoderLayer` reads): the MoE architectures."""
    module = sys.modules.get(model_class.__module__)
    return module is not None and any(isinstance(v, type) and getattr(v, "routes", False) is True
                                      for v in vars(module).values())


class HFCompatMixin:
    """Mixed into our ``PreTrainedModel`` classes (before ``PreTrainedModel``): every
    ``attn_implementation`` HF accepts loads (``eager``, ``sdpa``, ``flash_attention_2/3/4``,
    ``flex_attention``, hub kernels such as ``kernels-community/flash-attn``, None), even
    without flash-attn or ``kernels`` installed, and reads back from ``config._attn_implementation``
    as HF stores it; the aligned attention runs regardless and says so once per process (a
    ``logging`` warning on the ``vexact_models`` logger). Likewise every ``experts_implementation``
    loads on an MoE class (HF's heads pass e.g. ``grouped_mm``); the aligned MoE kernel runs. A
    dense class has no experts implementation to set (``_can_set_experts_implementation`` is
    False, as for HF's dense classes) and takes only ``eager``. Switching a loaded model's
    experts implementation (``set_experts_implementation``) would change nothing, so it is an
    error naming the value."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        resolved = resolve_attn_implementation(attn_implementation, type(self).__name__)
        note_attn_implementation(self.config, attn_implementation, resolved)
        return resolved

    def get_correct_attn_implementation(self, requested_attention: str | None, *args, **kwargs) -> str:
        resolved = resolve_attn_implementation(requested_attention, type(self).__name__)
        note_attn_implementation(self.config, requested_attention, resolved)
        return resolved

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None, *args, **kwargs) -> str:
        return resolve_experts_implementation(experts_implementation, type(self).__name__, has_routed_experts(type(self)))

    def get_correct_experts_implementation(self, requested_experts: str | None, *args, **kwargs) -> str:
        return resolve_experts_implementation(requested_experts, type(self).__name__, has_routed_experts(type(self)))

    def set_experts_implementation(self, experts_implementation: str | dict) -> None:
        """HF's ``set_experts_implementation``, which could only record a name: setting the
        current one is a no-op, another one a ValueError naming it (unknown names as in HF)."""
        current = self.config._experts_implementation
        requested = (experts_implementation.get("", current) if isinstance(experts_implementation, dict)
                     else experts_implementation)
        name, routed = type(self).__name__, has_routed_experts(type(self))
        resolve_experts_implementation(requested, name, routed)
        if requested != current:
            raise ValueError(f"{name}.set_experts_implementation({requested!r}) cannot be honoured: the aligned MoE "
                             "kernel runs whatever is set (batch-invariant routing and expert GEMMs, bitwise equal to "
                             f"rollouts); the model keeps experts_implementation={current!r}")

    # HF decides these by reading the class's module source for its attention / experts
    # interfaces; ours accept any attention value (`set_attn_implementation` records it), and an
    # experts implementation only where there are routed experts
    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return has_routed_experts(cls)


# --- Qwen3-MoE router_logits --------------------------------------------------------------------
# Up to 5.5.x, HF's Qwen3MoeTopKRouter returned the fp32 softmax probabilities under the name
# ``router_logits`` (and ``load_balancing_loss_func`` softmaxes them once more); 5.6.0 returns
# the raw logits. ``output_router_logits`` and the auxiliary loss follow the installed release,
# so that a drop-in gives stock HF's numbers. Routing itself never depends on this.
_QWEN3_MOE_ROUTER_RETURNS_PROBS = TRANSFORMERS_VERSION < Version("5.6.0")


def qwen3_moe_router_output(logits: torch.Tensor) -> torch.Tensor:
    """What stock Qwen3-MoE reports as one layer's ``router_logits`` on this transformers."""
    return torch.softmax(logits, dim=-1, dtype=torch.float32) if _QWEN3_MOE_ROUTER_RETURNS_PROBS else logits


# --- output_hidden_states as indices ----------------------------------------------------------
# Up to 5.16 ``output_hidden_states`` is a flag: a list of indices is merely truthy and selects
# every hidden state. 5.17 to 5.22 take a list, tuple or set of layer indices: entry i is layer
# i's output (the embeddings are not among them), one entry per layer, None where not selected;
# a negative index selects nothing. From 5.23 an int or a sequence selects among the
# num_layers + 1 hidden states (0: the embeddings), negative indices count from the end, those
# out of range are dropped, None where not selected. On every release an empty selection (or 0)
# is falsy: no hidden states at all. Where the last layer is selected, its entry is the final
# normed output (``last_hidden_state``), as HF ties it.
_HIDDEN_STATE_INDICES = ("states" if TRANSFORMERS_VERSION >= Version("5.23.0") else
                         "layers" if TRANSFORMERS_VERSION >= Version("5.17.0") else None)


def select_hidden_states(states: list, request) -> list:
    """What stock transformers returns as ``hidden_states`` for ``output_hidden_states=request``
    (truthy), given all of them (`states`: the embeddings, then each layer's output, the last
    being the final normed output): `states` itself for a flag, or on a release that takes no
    indices; else the entries the indices select, None elsewhere (see the comment above)."""
    if _HIDDEN_STATE_INDICES is None or isinstance(request, bool):
        return states
    if _HIDDEN_STATE_INDICES == "layers":
        if not isinstance(request, (list, tuple, set)):
            return states
        chosen = set(request)
        return [states[i + 1] if i in chosen else None for i in range(len(states) - 1)]
    count = len(states)
    chosen = {i % count for i in ([request] if isinstance(request, int) else list(request)) if -count <= i < count}
    return [state if i in chosen else None for i, state in enumerate(states)]


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


# --- the gated DeltaNet's A_log init -----------------------------------------------------------
# Stock's gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) draws ``A`` uniformly and keeps its
# log as ``A_log``, in ``__init__`` and again in ``_init_weights``. Up to 5.15.x from U(0, 16), the
# ``_init_weights`` draw in ``A_log``'s own dtype and device (``torch.empty_like``); from 5.16 from
# U(0.01, 16) (log A never -inf), that draw in float32 on ``A_log``'s device. Each draws
# ``num_v_heads`` values, so the generator ends in the same place either way; only the values
# differ. The forward (g = -exp(A_log) softplus(a + dt_bias)) is the same on every release.
_A_LOG_LOW = 0.01 if TRANSFORMERS_VERSION >= Version("5.16.0") else 0.0


def gated_deltanet_a_log_init(a_log: torch.Tensor) -> torch.Tensor:
    """What stock's ``_init_weights`` of this release copies into a gated DeltaNet's `a_log` (the
    log of ``A`` drawn from the global generator; see the comment above)."""
    if _A_LOG_LOW:
        return torch.empty(a_log.shape[0], device=a_log.device).uniform_(_A_LOG_LOW, 16).log_()
    return torch.empty_like(a_log).uniform_(0, 16).log_()


def gated_deltanet_a_log(num_v_heads: int) -> torch.Tensor:
    """``A_log`` as stock's gated DeltaNet ``__init__`` of this release makes it (float32, CPU)."""
    return torch.empty(num_v_heads).uniform_(_A_LOG_LOW, 16).log()
