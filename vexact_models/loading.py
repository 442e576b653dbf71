"""What our ``from_pretrained`` accepts: transformers' leniency where it is lenient on purpose,
an error naming the tensor where the decoder's own weights are wrong.

transformers loads a checkpoint into a class that has more weights than the checkpoint (a causal
LM's checkpoint into ``*ForSequenceClassification`` / ``*ForTokenClassification``: a new
``score``; a base model's checkpoint into ``*ForCausalLM``: a new ``lm_head``), initialises the
missing weights with the model's ``_init_weights``, lists them in the loading info
(``output_loading_info=True``) and in its load report (a warning on the
``transformers.modeling_utils`` logger). That is how verl builds its PPO critic and TRL its reward
model, from the policy's checkpoint, and our classes do the same: transformers does the loading.
What it would also accept silently, a decoder weight (``model.*``) missing from the checkpoint,
is an error here (`CheckpointError`), as is a tensor of the wrong shape unless the caller passed
``ignore_mismatched_sizes=True`` (transformers then initialises it anew and lists it in
``mismatched_keys``; without the flag it raises ``RuntimeError`` pointing at its report, which
`CheckpointError` is, naming the tensor). Releases 5.2 to 5.24 report loads the same way
(``transformers.utils.loading_report``).
"""

from __future__ import annotations

from torch import nn
from transformers import Mxfp4Config

from .fp8 import FP8_ADVICE
from .hub_config import checkpoint_config, dequantize_requested, quant_method
from .mxfp4 import MXFP4_ADVICE, mxfp4_quantized

#: Names listed in one error at most (a whole missing layer would list dozens).
LIST_AT_MOST = 8


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint that does not fit the model: a missing decoder tensor, a tensor of the wrong
    shape. A ``RuntimeError``, as transformers raises for a mis-shaped tensor (so callers that
    catch transformers' error catch ours), and a ``ValueError`` (bad input)."""


def listed(items: list[str], joined: bool = False) -> str:
    """At most `LIST_AT_MOST` of `items` (a list's repr, or `joined` by commas), and how many
    more there are."""
    shown = ", ".join(items[:LIST_AT_MOST]) if joined else str(items[:LIST_AT_MOST])
    more = f" and {len(items) - LIST_AT_MOST} more" if len(items) > LIST_AT_MOST else ""
    return shown + more


def decoder_prefix(model: nn.Module) -> str:
    """The prefix of the decoder's own weights in `model`'s state dict: ``"model."`` for a model
    with a head (causal LM, classification heads), ``""`` for the base model itself."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""


#: ``from_pretrained`` arguments (and ``DistributedConfig`` fields, where the release has them) that ask
#: transformers to shard weights across ranks inside the layers: tensor, expert and sequence
#: parallelism. The value each takes when it asks for nothing.
SHARDING_INSIDE_LAYERS = {"tp_plan": None, "tp_size": 1, "ep_size": 1, "enable_expert_parallel": False,
                          "enable_sequence_parallel": False}


def refuse_sharding_inside_layers(name: str, kwargs: dict) -> None:
    """A ValueError, before anything loads, where ``from_pretrained``'s `kwargs` ask transformers
    for tensor, expert or sequence parallelism (``tp_plan="auto"``, ``tp_size``, or a
    ``distributed_config`` with them): it turns the layers' weights into DTensors, which the
    aligned kernels do not run (the forward would fail on the first mixed op). FSDP2 shards
    whole weights and gathers them for each layer, which they do run."""
    config = kwargs.get("distributed_config")
    asked = [(key, kwargs.get(key)) for key in ("tp_plan", "tp_size")]
    asked += [(f"distributed_config.{key}", getattr(config, key, None)) for key in SHARDING_INSIDE_LAYERS]
    for key, value in asked:
        if value is None or value == {} or value == SHARDING_INSIDE_LAYERS[key.rpartition(".")[2]]:
            continue  # an empty plan turns tensor parallelism off
        raise ValueError(f"{name}.from_pretrained: {key}={value!r} asks transformers to shard weights inside the "
                         "layers, whose DTensors the aligned kernels do not run; shard with FSDP2 "
                         "(vexact_models.distributed, docs/fsdp.md) and roll out with LLM(..., "
                         "pipeline_parallel_size=N)")


def refuse_quantized_checkpoint(name: str, source, kwargs: dict) -> None:
    """A ValueError, before anything loads, where ``from_pretrained(source, **kwargs)`` of class
    `name` would read weights the aligned kernels do not run without asking transformers to
    dequantize them: MXFP4 experts (published GPT-OSS, `mxfp4.MXFP4_ADVICE`) or block-FP8
    weights (published DeepSeek-V3, `fp8.FP8_ADVICE`); the message says what to do."""
    if dequantize_requested(kwargs.get("quantization_config")):
        return
    try:
        method = quant_method(checkpoint_config(source, kwargs))
    except (OSError, ValueError, TypeError):  # no config there: transformers' own error follows
        return
    advice = {"mxfp4": MXFP4_ADVICE, "fp8": FP8_ADVICE}.get(method)
    if advice is not None:
        raise ValueError(f"{name}.from_pretrained({str(source)!r}): {advice}")


def check_loading_info(model: nn.Module, info: dict, ignore_mismatched_sizes: bool) -> None:
    """After transformers' ``from_pretrained(..., output_loading_info=True,
    ignore_mismatched_sizes=True)`` of `model`: raise `CheckpointError` naming every decoder
    tensor the checkpoint lacks, and every tensor of the wrong shape unless
    `ignore_mismatched_sizes`. Head weights the checkpoint lacks (a new ``score`` or
    ``lm_head``) are left as transformers initialised and reported them."""
    name = type(model).__name__
    prefix = decoder_prefix(model)
    missing = sorted(k for k in info.get("missing_keys") or () if k.startswith(prefix))
    if missing:
        raise CheckpointError(f"{name}.from_pretrained: the checkpoint is missing tensor(s) {listed(missing)} of the "
                              "decoder (only weights a head adds, such as a new score or lm_head, may be missing)")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if mismatched and not ignore_mismatched_sizes:
        detail = [f"{key} has shape {tuple(got)} but the model expects {tuple(want)}" for key, got, want in mismatched]
        raise CheckpointError(f"{name}.from_pretrained: checkpoint tensor(s) with the wrong shape: "
                              f"{listed(detail, joined=True)} (ignore_mismatched_sizes=True initialises them anew, "
                              "as transformers does)")


def from_pretrained_complete(model_class: type, path: str, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` for the rollout engine, which samples from
    every weight: transformers' leniency (a head weight the checkpoint lacks, such as ``lm_head``
    in a base model's checkpoint, initialised anew) would roll out from random logits, so any
    tensor the checkpoint lacks is a `CheckpointError` naming it. A tied head is not missing. An MXFP4
    checkpoint (published GPT-OSS) loads dequantized to the model dtype, as
    ``quantization_config=Mxfp4Config(dequantize=True)`` does (`vexact_models.mxfp4`): the engine
    runs no other form."""
    if mxfp4_quantized(checkpoint_config(path, kwargs)) and not dequantize_requested(kwargs.get("quantization_config")):
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise CheckpointError(f"{model_class.__name__}.from_pretrained({str(path)!r}) for rollouts: the checkpoint is "
                              f"missing tensor(s) {listed(missing)}; a rollout engine cannot sample from weights "
                              "initialised anew (load the training class for a new head)")
    return model
