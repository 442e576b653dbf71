"""Helpers of `vexact_models.integrations.verl`: the actor's logprob forward, the weight stream
from verl's trainer into the engine, and verl's sampling-parameter dicts.

Kept apart from the rollout classes so that each file reads on its own; nothing here is public.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from collections.abc import Iterable, Iterator

import torch
from verl.models.transformers.dense_common import CausalLMOutputForPPO
from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

from vexact_models.causal_lm import final_logit_softcap
from vexact_models.kernels import token_logprobs
from vexact_models.rl import entropy_rows
from vexact_models.runtime import LLM, SamplingParams

# ----------------------------------------------------------------------------------------------
# Configuration: verl's RolloutConfig
# ----------------------------------------------------------------------------------------------

OPTIONS_KEY = "vexact"  # rollout.engine_kwargs.vexact: LLM arguments and the options below
OWN_OPTIONS = {"sleep_level": 2}
#: options of earlier releases, and why they went
REMOVED_OPTIONS = {"batch_window_ms": "requests now join the engine's running batch as they arrive (its online "
                                      "requests), so there is no batch to wait for; remove it"}


def engine_options(config) -> dict:
    """``rollout.engine_kwargs.vexact`` (LLM keyword arguments plus `OWN_OPTIONS`), checked."""
    opts = dict(((getattr(config, "engine_kwargs", None) or {}).get(OPTIONS_KEY)) or {})
    for name in sorted(set(opts) & set(REMOVED_OPTIONS)):
        raise ValueError(f"rollout.engine_kwargs.{OPTIONS_KEY}.{name}={opts[name]!r}: {REMOVED_OPTIONS[name]}")
    allowed = set(inspect.signature(LLM).parameters) - {"model"} | set(OWN_OPTIONS)
    unknown = sorted(set(opts) - allowed)
    if unknown:
        raise ValueError(f"rollout.engine_kwargs.{OPTIONS_KEY}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    return opts


def check_parallel(config) -> None:
    for field in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(config, field, 1)
        if value != 1:
            raise ValueError(f"rollout.{field}={value}: the vexact backend runs one engine per rank; set it to 1")


def max_model_len_of(config) -> int:
    return int(config.max_model_len or config.prompt_length + config.response_length)


# ----------------------------------------------------------------------------------------------
# Actor side: verl's fused-kernel forward contract, computed by our kernels
# ----------------------------------------------------------------------------------------------


def _lm_head_weight(model) -> torch.Tensor:
    # lm_head_weight() is the accessor that also handles PEFT's modules_to_save copy
    getter = getattr(model, "lm_head_weight", None)
    return getter() if callable(getter) else model.lm_head.weight


def _scalar_temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"verl forward: temperature must be one number (verl's fused-kernel path asserts a "
                             f"scalar), got a tensor of shape {tuple(temperature.shape)}")
        temperature = temperature.item()
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"verl forward: temperature={temperature} must be > 0")
    return temperature


def ppo_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, temperature, shift_labels: torch.Tensor | None,
                labels: torch.Tensor | None) -> CausalLMOutputForPPO:
    """What verl's fused-kernel forward returns (``log_probs`` and ``entropy`` in the input's
    shape), with ``log_probs[t] = log softmax(logits_t / T)[label_t]`` computed by the same kernel
    on the same hidden rows as `token_logprobs`, hence bitwise equal to the rollout's logprob of
    that token. Labels are verl's ``shift_labels`` (its globally rolled ids), else ``labels`` or
    ``input_ids`` rolled left by one, as verl's own fused forwards do; the label at a sequence's
    last token is the next sequence's first, a value verl drops."""
    if input_ids is None:
        raise ValueError("verl forward: input_ids is required (inputs_embeds is not supported on this path)")
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:  # each rank would hold a slice of every sequence: our attention needs whole sequences
        raise ValueError(f"verl forward: ulysses_sequence_parallel_size={sp} is not supported; set it to 1")
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cu_seqlens=cu_seqlens).last_hidden_state
    if shift_labels is None:
        shift_labels = torch.roll(labels if labels is not None else input_ids, shifts=-1, dims=-1)
    if shift_labels.shape != input_ids.shape:
        raise ValueError(f"verl forward: shift_labels shape {tuple(shift_labels.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1)
    keep = None if attention_mask is None else attention_mask.reshape(-1).bool().nonzero().squeeze(1)
    if keep is not None:  # padding rows carry no token: skip their lm_head work
        rows, targets = rows[keep], targets[keep]
    t = _scalar_temperature(temperature)
    weight, softcap = _lm_head_weight(model), final_logit_softcap(model.config)
    lp = token_logprobs(rows, weight, targets, t, softcap=softcap)
    ent = entropy_rows(rows, weight, t, softcap)
    if keep is not None:
        lp = lp.new_zeros(input_ids.numel()).index_copy(0, keep, lp)
        ent = ent.new_zeros(input_ids.numel()).index_copy(0, keep, ent)
    return CausalLMOutputForPPO(log_probs=lp.view(input_ids.shape), entropy=ent.view(input_ids.shape))


def verl_forward(original):
    """Wrap a causal LM's ``forward``: a call carrying ``temperature`` (verl's fused-kernel
    contract, ``actor_rollout_ref.model.use_fused_kernels=True``) returns `ppo_outputs`, with
    autocast off so that the kernels run exactly as in the rollout; any other call is the
    original forward."""
    @functools.wraps(original)  # keeps the signature: verl reads it to decide on passing cu_seqlens
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, temperature=None,
                shift_labels=None, **kwargs):
        kwargs.pop("cu_seqlens_cpu", None)  # verl's host copy of cu_seqlens, for flash-attn
        if temperature is None:
            return original(self, input_ids, attention_mask, position_ids, *args, **kwargs)
        if args:
            raise ValueError(f"{type(self).__name__}.forward (verl path): pass arguments after position_ids by name")
        device_type = (input_ids.device if input_ids is not None else torch.device("cpu")).type
        with torch.autocast(device_type=device_type, enabled=False):
            return ppo_outputs(self, input_ids, attention_mask, position_ids, kwargs.get("cu_seqlens"), temperature,
                               shift_labels, kwargs.get("labels"))

    forward._vexact_verl_original = original
    return forward


# ----------------------------------------------------------------------------------------------
# Weights: verl streams MoE experts one by one (its ``unfuse_moe_params``); the engine holds them
# fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``)
# ----------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


class ExpertRefuser:
    """Puts per-expert tensors (``...experts.<e>.gate_proj.weight`` ...) back into the engine's
    fused tensors, named in `shapes` (the engine's parameter shapes). `push` one ``(name,
    tensor)`` pair at a time: it returns the pairs ready for the engine, the pair itself when it
    is not an expert's (or has no fused home in `shapes`: the engine then rejects it by name), a
    fused tensor once all its experts arrived (verl sends a layer's experts together, so at most
    one layer's experts are held), else nothing. `close` checks that nothing is left half-filled."""

    def __init__(self, shapes: dict[str, torch.Size]) -> None:
        self.shapes = shapes
        self.pending: dict[str, tuple[torch.Tensor, set]] = {}

    def push(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = _EXPERT.match(name)
        fused = None if m is None else m["base"] + (".down_proj" if m["kind"] == "down_proj" else ".gate_up_proj")
        if fused is None or fused not in self.shapes:
            return [(name, tensor)]
        shape, e = self.shapes[fused], int(m["e"])
        if fused not in self.pending:
            self.pending[fused] = (torch.empty(shape, dtype=tensor.dtype, device=tensor.device), set())
        buf, seen = self.pending[fused]
        if not 0 <= e < shape[0]:
            raise ValueError(f"update_weights: {name} names expert {e}, but {fused} {tuple(shape)} has {shape[0]}")
        half = shape[1] // 2
        part = {"gate_proj": buf[e, :half], "up_proj": buf[e, half:], "down_proj": buf[e]}[m["kind"]]
        if part.shape != tensor.shape:
            raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, but expert {e} of {fused} "
                             f"{tuple(shape)} takes {tuple(part.shape)}")
        part.copy_(tensor)
        seen.add((e, m["kind"]))
        if len(seen) < shape[0] * (1 if m["kind"] == "down_proj" else 2):
            return []
        del self.pending[fused]
        return [(fused, buf)]

    def close(self) -> None:
        if self.pending:
            missing = sorted(self.pending)
            self.pending.clear()
            raise ValueError(f"update_weights: the stream ended with experts missing from {missing}")


def refuse_experts(weights: Iterable[tuple[str, torch.Tensor]],
                   shapes: dict[str, torch.Size]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with verl's per-expert tensors fused back (see `ExpertRefuser`), lazily."""
    refuser = ExpertRefuser(shapes)
    for name, tensor in weights:
        yield from refuser.push(name, tensor)
    refuser.close()


def plain_name(name: str) -> str:
    """`name` without PEFT's ``base_layer`` segments (none on a model without adapters)."""
    return name.replace(".base_layer", "")


def engine_pairs(weights: Iterable[tuple[str, torch.Tensor]], names: dict[str, str],
                 adapter_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as the engine takes them, lazily: each base tensor renamed to the engine's
    parameter `names` maps its `plain_name` to (names the engine lacks pass unchanged: the engine
    then names what it rejects); each adapter tensor (``lora_`` in the name) cast to the engine's
    `adapter_dtype` where given: verl sends its fp32 masters, and the trainer computes with them
    rounded to the model's dtype, as the base weights are."""
    for name, tensor in weights:
        if "lora_" not in name:
            yield names.get(plain_name(name), name), tensor
        elif adapter_dtype is not None and tensor.is_floating_point():
            yield name, tensor.to(adapter_dtype)
        else:
            yield name, tensor


def copy_buffers(weights: Iterable[tuple[str, torch.Tensor]],
                 buffers: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Copy the pairs naming one of `buffers` (verl streams the trainer's ``state_dict()``, which
    holds persistent buffers such as DeepSeek's ``e_score_correction_bias``) in place; yield the
    rest (the parameters, for ``LLM.update_weights``)."""
    for name, tensor in weights:
        target = buffers.get(name)
        if target is None:
            yield name, tensor
            continue
        if target.shape != tensor.shape:
            raise ValueError(f"update_weights: buffer {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)


# ----------------------------------------------------------------------------------------------
# LoRA: with ``actor_rollout_ref.model.lora.merge=False`` verl's trainer sends its adapters alone
# (``get_peft_model_state_dict`` names), with ``peft_config`` (its ``LoraConfig.to_dict()``)
# ----------------------------------------------------------------------------------------------

#: the LoraConfig fields that decide which adapter tensors exist and what they compute
LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "target_parameters",
               "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "modules_to_save", "bias",
               "use_dora", "fan_in_fan_out", "lora_bias")


def lora_fields(peft_config) -> dict:
    """`LORA_FIELDS` of verl's ``peft_config`` (a dict, or a PEFT ``LoraConfig``), sets as sorted
    lists; a ValueError for a config that is not LoRA's."""
    fields = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
    kind = str(getattr(fields.get("peft_type"), "value", fields.get("peft_type")))
    if kind != "LORA":
        raise ValueError(f"update_weights: peft_config has peft_type={kind!r}; only LoRA adapters are supported")
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in fields.items() if k in LORA_FIELDS}


def add_adapters(model: torch.nn.Module, fields: dict) -> None:
    """Inject LoRA adapters of `fields` (`lora_fields`) into the engine's causal LM `model`, in
    the model's dtype (as the trainer computes with them under verl's mixed precision), with
    PEFT's ``inject_adapter_in_model``; the engine reads them at its next step."""
    from peft import LoraConfig, inject_adapter_in_model

    if fields.get("modules_to_save"):
        raise ValueError(f"update_weights: peft_config modules_to_save={fields['modules_to_save']} is not supported "
                         "with unmerged adapters; set actor_rollout_ref.model.lora.merge=True")
    inject_adapter_in_model(LoraConfig(**fields), model)


# ----------------------------------------------------------------------------------------------
# Requests: verl's sampling-parameter dicts (vLLM's names) -> SamplingParams
# ----------------------------------------------------------------------------------------------

_PASS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "ignore_eos", "seed", "stop_token_ids", "stop",
         "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty",
         "allowed_token_ids", "logit_bias", "structured_outputs", "bad_words", "prompt_logprobs")
#: vLLM options verl may send that do not change which tokens are sampled
_HARMLESS = ("skip_special_tokens", "spaces_between_special_tokens", "detokenize")
#: vLLM options we accept only at their neutral value
_NEUTRAL = {"n": 1}


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each sampled token of a `CompletionOutput`: its floats, or with
    ``SamplingParams(logprobs=k)`` each position's entry for the sampled token (vLLM's shape)."""
    if not completion.logprobs or not isinstance(completion.logprobs[0], dict):
        return list(completion.logprobs)
    return [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]


def prompt_scores(scores, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """verl's ``extra_fields["prompt_ids"]`` and ``["prompt_logprobs"]`` (what its distillation
    teacher reads: `verl.experimental.teacher_loop`) from a request's ``prompt_logprobs`` (vLLM's
    list: None, then a dict ``{token: Logprob}`` per prompt token): one row per prompt token, each
    ``max(k, 1)`` wide. Row p scores the token at p + 1: with ``k == 0`` that token and its
    logprob, else the k most probable tokens and theirs, by rank (equal ranks in the dict's order:
    the scored token first). The last row, which scores nothing, is zeros."""
    ids, logprobs = [], []
    for position in scores[1:]:
        entries = list(position.items())
        if k:
            entries = sorted(entries, key=lambda entry: entry[1].rank)[:k]
        ids.append([token for token, _ in entries[:max(k, 1)]])
        logprobs.append([value.logprob for _, value in entries[:max(k, 1)]])
    ids.append([0] * max(k, 1))
    logprobs.append([0.0] * max(k, 1))
    return ids, logprobs


def request_seed(base_seed: int, replica_rank: int, request_id: str) -> int:
    """A seed fixed by (run seed, replica, request id): reproducible runs under
    ``rollout.full_determinism`` whatever order requests arrive in."""
    digest = hashlib.sha256(f"{base_seed}:{replica_rank}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # in [0, 2**63)


def sampling_params(params: dict, prompt_len: int, config, *, max_model_len: int,
                    seed: int | None = None) -> tuple[SamplingParams, bool]:
    """``(SamplingParams, whether logprobs were asked for)`` from verl's request dict, with the
    ``max_tokens`` default and clamping of verl's vLLM server (``rollout.response_length``,
    ``prompt_length + response_length - len(prompt)``, room left in ``max_model_len``). An option
    the engine cannot honour is a ValueError naming it, never silently dropped."""
    params = dict(params)
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"generate: prompt length {prompt_len} leaves no room below max_model_len={max_model_len}")
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
    if max_tokens is None:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    max_tokens = max(1, min(int(max_tokens), room))
    logprobs = params.pop("logprobs", None)
    alternatives = isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > 0
    if not alternatives and logprobs not in (None, False, True, 0):
        raise ValueError(f"generate: sampling_params['logprobs']={logprobs!r} must be None, a bool or an int >= 0")
    for key, neutral in _NEUTRAL.items():
        value = params.pop(key, neutral)
        if value != neutral:
            raise ValueError(f"generate: sampling_params[{key!r}]={value!r} is not supported (only {neutral!r})")
    for key in _HARMLESS:
        params.pop(key, None)
    kwargs = {key: params.pop(key) for key in _PASS if key in params}
    if alternatives:  # vLLM's alternatives: the engine computes them, verl reads the sampled token's
        kwargs["logprobs"] = logprobs
    for key in ("stop", "include_stop_str_in_output"):  # vLLM's None, [] or False: its defaults
        if not kwargs.get(key):
            kwargs.pop(key, None)
    if params:
        raise ValueError(f"generate: unsupported sampling_params {sorted(params)}; supported: "
                         f"{sorted(_PASS + _HARMLESS + tuple(_NEUTRAL) + ('max_tokens', 'logprobs'))}")
    kwargs.setdefault("ignore_eos", bool(getattr(config, "ignore_eos", False)))
    if kwargs.get("seed") is None and seed is not None:
        kwargs["seed"] = seed
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = list(kwargs["stop_token_ids"] or [])
    return SamplingParams(max_tokens=max_tokens, **kwargs), logprobs is not None and logprobs is not False
