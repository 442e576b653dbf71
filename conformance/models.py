"""Models to check: configs (tiny shapes and bundled published configs) and random-weight models
built as users build them. Used by the conformance CLI, the benchmarks, the examples and the
tests (``vexact_models.conformance.models``).

A bundled published config (``conformance/configs/<name>.json``, e.g. ``moonlight-16b-a3b``)
belongs to the architecture serving its ``model_type`` and to the `Shape` that lists it in
``published_configs`` (`published_shape`).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from vexact_models.adapters import expert_target_parameters
from vexact_models.deepseek_v3.latent_attention import mla_kv_cache_mode
from vexact_models.gated_deltanet import linear_chunk_size
from vexact_models.kernels.attention_tiles import HEAD_DIMS
from vexact_models.multimodal import is_multimodal, text_config_of
from vexact_models.registry import Architecture, Shape, architectures, for_model_type

#: the bundled published configs (``<name>.json``; `published_config` takes ``<name>``)
CONFIG_DIR = Path(__file__).parent / "configs"
#: config.json fields that are not config arguments
_NOT_FIELDS = ("architectures", "torch_dtype")
#: the smallest head dim the GPU attention takes; the tiny test configs' are smaller
MIN_GPU_HEAD_DIM = min(HEAD_DIMS)
#: config fields our models read that no transformers config class declares (an override may set
#: them), each with the reader that refuses a bad value (None: any value is taken)
VEXACT_CONFIG_FIELDS: dict[str, Callable | None] = {"linear_chunk_size": linear_chunk_size,
                                                    "mla_kv_cache": mla_kv_cache_mode,
                                                    "token_classification_bias": None}


def bundled_configs() -> list[str]:
    """The names of the bundled published configs (``qwen3-0.6b``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.is_file():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"config {name_or_path!r}: no such file, and not one of the bundled configs {bundled_configs()}")
    return path


def parse_overrides(items: list[str] | None) -> dict:
    """``["n_routed_experts=64", "q_lora_rank=null"]`` -> config fields (values parsed as JSON,
    else kept as strings)."""
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def published_config(name_or_path: str) -> dict:
    """A config dict from a bundled published config name (``qwen3-0.6b``) or a config.json path
    (of a published multimodal model: its text model's, `vexact_models.multimodal`); a ValueError
    listing the bundled names when it is neither."""
    config = json.loads(_config_path(name_or_path).read_text())
    return text_config_of(config).to_dict() if is_multimodal(config) else config


def published_shape(name_or_path: str) -> tuple[Architecture, Shape | None]:
    """The registered architecture serving a published config's ``model_type``, and the shape
    whose ``published_configs`` lists it (None for a config.json that is not bundled, or that no
    shape lists). A ValueError when no architecture serves the model_type."""
    path = _config_path(name_or_path)
    model_type = published_config(name_or_path).get("model_type")
    arch = for_model_type(model_type)
    if arch is None:
        raise ValueError(f"config {name_or_path!r}: no registered architecture serves model_type {model_type!r}; "
                         f"registered: {sorted(a.name for a in architectures())}")
    bundled = path.resolve().parent == CONFIG_DIR.resolve()
    shape = next((s for s in arch.shapes if bundled and path.name in s.published_configs), None)
    return arch, shape


def architecture_of(config_name: str) -> Architecture:
    """The registered architecture serving a published config's ``model_type`` (`published_shape`)."""
    return published_shape(config_name)[0]


def make_config(arch: Architecture, config_name: str | None = None, layers: int | None = None,
                max_positions: int | None = None, overrides: dict | None = None, shape: str | None = None):
    """The config to build: the tiny config of `arch`'s `shape` (default: its first) when
    `config_name` is None or ``"tiny"``, else a published one (a bundled name or a config.json
    path, which must be of `arch`'s model_type), with ``num_hidden_layers`` (`layers`),
    ``max_position_embeddings`` (`max_positions`, published configs only) and any other fields
    (`overrides`) replaced. A ValueError for a layer count below 1 or an override naming a field
    the config does not have (a typo would otherwise be kept as an unread attribute)."""
    if layers is not None and layers < 1:
        raise ValueError(f"layers={layers} must be >= 1")
    fields = dict(overrides or {})
    if layers:
        fields["num_hidden_layers"] = layers
    if config_name is None or config_name == "tiny":
        tiny = arch.shape(shape) if shape else arch.shapes[0]
        _check_overrides(arch, overrides, tiny.tiny_config().to_dict())
        return _checked_values(tiny.tiny_config(**fields), overrides)
    published = published_config(config_name)
    if published.get("model_type") not in arch.model_types:
        raise ValueError(f"config {config_name!r}: model_type {published.get('model_type')!r} is not one of "
                         f"architecture {arch.name!r}'s {list(arch.model_types)}")
    published = {k: v for k, v in published.items() if k not in _NOT_FIELDS}
    _check_overrides(arch, overrides, published)
    if layers and isinstance(published.get("layer_types"), list):  # hybrids: the first layers' types
        published["layer_types"] = published["layer_types"][:layers]
    if max_positions:
        fields["max_position_embeddings"] = max_positions
    return _checked_values(arch.config_class(**{**published, **fields}), overrides)


def _checked_values(config, overrides: dict | None):
    """`config`, after each overridden `VEXACT_CONFIG_FIELDS` value passed its reader (a
    ValueError naming the field and the value, before a model is built on it)."""
    for key in overrides or {}:
        reader = VEXACT_CONFIG_FIELDS.get(key)
        if reader is not None:
            reader(config)
    return config


def _check_overrides(arch: Architecture, overrides: dict | None, base: dict) -> None:
    """Every override names a field of `arch`'s config class, of the `base` config it changes, or
    one of `VEXACT_CONFIG_FIELDS`; a ValueError naming the first that does not."""
    known = {*arch.config_class().to_dict(), *base, *VEXACT_CONFIG_FIELDS}
    for key, value in (overrides or {}).items():
        if key not in known:
            close = sorted(k for k in known if key in k or k in key)[:5]
            raise ValueError(f"config override {key}={json.dumps(value)}: {arch.config_class.__name__} has no field "
                             f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))


def construct(cls: Callable, config, device: torch.device, dtype: torch.dtype):
    """``cls(config)`` initialised directly on `device` in `dtype` (an 8B model initialised on
    CPU takes minutes). `cls` is a model class or any callable taking the config."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def hf_twin(arch: Architecture, model, device: torch.device | None = None, dtype: torch.dtype | None = None,
            attn_implementation: str | None = None, stock_experts: bool = False):
    """The stock transformers class of `arch` holding `model`'s weights, built directly on `device`
    in `dtype` (default: where `model`'s weights are, in their dtype; `construct`), with
    `attn_implementation` where given (else the class's default), tied as `model`'s config says.
    Its MoE experts run the implementation `model`'s config names (ours say ``eager``: stock's
    loop over experts, the parity reference), or with `stock_experts` the one stock picks for a
    config of its own (transformers' ``grouped_mm`` where torch has it; what a user of stock
    runs, so the benchmarks' peer). Raises RuntimeError when the two state dicts differ (a tied
    LM head aside)."""
    weight = next(model.parameters())
    device, dtype = device or weight.device, dtype or weight.dtype
    cls = arch.hf_class()
    if attn_implementation is None and getattr(model.config, "_attn_implementation", None) == "sdpa" \
            and not getattr(cls, "_supports_sdpa", True):
        attn_implementation = "eager"  # GPT-OSS: stock has no sdpa path (its sinks), only eager
    chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if stock_experts:
        chosen["experts_implementation"] = None  # stock's own default, as for a config it built itself
    if chosen:
        cls = functools.partial(cls._from_config, dtype=dtype, **chosen)
    # a copy: ``_from_config`` sets the implementations on the config it is given, and ours is `model`'s
    hf = construct(cls, copy.deepcopy(model.config), device, dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"hf_twin: state dicts differ: missing {missing}, unexpected {unexpected}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def build_model(arch: Architecture, config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight training-variant model of `arch` for `config`, built as users build it
    (`vexact_models.patch()`, then ``AutoModelForCausalLM.from_config``) directly on `device` in
    `dtype`, in eval mode, with ``arch.init_for_conformance`` applied. Leaves the Auto classes
    patched only if they were before. A RuntimeError if patch() did not route the config to
    `arch`'s class."""
    from transformers import AutoModelForCausalLM

    from vexact_models import is_patched, patch, unpatch

    was_patched = is_patched()
    patch()
    try:
        torch.manual_seed(seed)
        model = construct(lambda c: AutoModelForCausalLM.from_config(c, dtype=dtype), config, device, dtype).eval()
    finally:
        if not was_patched:
            unpatch()
    if type(model) is not arch.causal_lm_class:
        raise RuntimeError(f"vexact_models.patch() did not route model_type {config.model_type!r}: "
                           f"AutoModelForCausalLM.from_config returned {type(model).__module__}.{type(model).__name__}")
    if arch.init_for_conformance is not None:
        with torch.no_grad():
            arch.init_for_conformance(model, seed)
    return model


def add_random_lora(model, rank: int, seed: int = 0):
    """`model` under real PEFT LoRA adapters of `rank` on every linear layer (PEFT's
    ``all-linear``) and, on MoE models, on both fused expert tensors (``target_parameters``),
    with random A and B so that the adapters change every output. Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                        init_lora_weights=False, target_parameters=expert_target_parameters(model))
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random init is uniform at nn.Linear's scale; shrink B to a fine-tuned size
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
    return peft_model


def lora_targets(peft_model) -> str:
    """What `add_random_lora` adapted, for the CLI's log: the number of adapted linear layers and,
    on MoE models, of fused expert tensors and of other parameters PEFT adapted in place (its
    ``ParamWrapper``; the routers' weights, which PEFT adds to ``all-linear`` on MoE models)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    wrapped = [m for m in layers if isinstance(m, ParamWrapper)]
    experts = sum(m.parameter_name in ("gate_up_proj", "down_proj") for m in wrapped)
    parts = [f"{len(layers) - len(wrapped)} linear layers"]
    parts += [f"{experts} fused expert tensors"] if experts else []
    parts += [f"{len(wrapped) - experts} router weights"] if len(wrapped) > experts else []
    return " and ".join([", ".join(parts[:-1]), parts[-1]]) if len(parts) > 1 else parts[0]
