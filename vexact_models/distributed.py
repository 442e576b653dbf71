"""Sharded training with FSDP2, and weights from the shards into the rollout engine.

    import torch.distributed as dist
    from vexact_models.distributed import shard, stream_full_weights

    dist.init_process_group("nccl")                     # or "gloo" on CPU
    model = AutoModelForCausalLM.from_pretrained(path)  # after vexact_models.patch()
    shard(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lp = model.token_logprobs(ids)                      # == the rollout's logprobs, bitwise
    ...optimizer step...
    llm.update_weights(stream_full_weights(model, dtype=torch.bfloat16))  # every rank, in step

`shard` is the usual FSDP2 recipe: ``fully_shard`` on every decoder layer, then on the whole
model, with `token_logprobs` registered as a forward method so that it runs the root's
all-gather hooks (it does not go through ``forward``). The plain recipe works as well: our
`token_logprobs` registers itself the first time it is called on an ``FSDPModule``
(`fsdp_forward_method`).

Why the logprobs stay bitwise: FSDP2 gathers each parameter's exact values (an all-gather
concatenates shards, no arithmetic), so a sharded forward runs the same kernels on the same
weights as a single process; the kernels are batch-invariant, so a sequence's numbers do not
depend on which rank or micro-batch holds it. Only gradients are reduced across ranks, so only
they may differ from a single process, by fp32 summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from .adapter_weights import adapter_tensors

__all__ = ["FORWARD_METHODS", "LAUNCHER_WORLD_SIZE_VARS", "checkpoint_name", "exit_rank", "fsdp_forward_method",
           "launcher_world_size", "register_forward_methods", "shard", "stream_full_weights"]

#: Methods other than ``forward`` that run the model and so must run FSDP's forward hooks.
FORWARD_METHODS = ("token_logprobs",)

# Wrapper modules that prefix parameter names (activation checkpointing, torch.compile, FSDP1);
# the engine knows the checkpoint's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _fsdp_module_class():
    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_forward_method(method):
    """Decorate a model method that runs the forward without calling ``forward`` (e.g.
    ``token_logprobs``) so that it also works when the model is an FSDP2 root: on the first call
    on an ``FSDPModule`` it registers itself with ``register_fsdp_forward_method`` (which
    installs an instance attribute running FSDP's pre/post-forward hooks around this method)
    and goes through that. Unsharded models call the method directly."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        fsdp_module = _fsdp_module_class()
        # `name` in the instance dict: FSDP's wrapper is installed and is what called us
        if fsdp_module is None or not isinstance(self, fsdp_module) or name in vars(self):
            return method(self, *args, **kwargs)
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(self, name)
        return getattr(self, name)(*args, **kwargs)

    wrapper._vexact_fsdp_forward = True
    return wrapper


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"shard: model {type(model).__name__} has no decoder layers (expected model.model.layers, "
                         "a non-empty nn.ModuleList, as in every vexact-models causal LM)")
    return layers


def _mixed_precision(mp_policy, param_dtype, reduce_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(f"shard: pass either mp_policy ({mp_policy}) or param_dtype/reduce_dtype "
                         f"({param_dtype}/{reduce_dtype}), not both")
    for arg, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"shard: {arg}={dtype!r} is not a floating-point torch.dtype")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"shard: mp_policy={mp_policy!r} is not a torch.distributed.fsdp.MixedPrecisionPolicy")
    if mp_policy is not None and mp_policy.output_dtype is not None:
        raise ValueError(f"shard: mp_policy.output_dtype={mp_policy.output_dtype} would round the fp32 logprobs and "
                         "logits; leave it None")
    return mp_policy or MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _default_mesh(model: nn.Module):
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard: torch.distributed is not initialised; call dist.init_process_group(...) "
                           "(e.g. under torchrun) or pass a DeviceMesh as mesh")
    device = next(model.parameters()).device
    device_type = "cuda" if device.type in ("cuda", "meta") and torch.cuda.is_available() else device.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard(model: nn.Module, mesh=None, *, mp_policy=None, param_dtype: torch.dtype | None = None,
          reduce_dtype: torch.dtype | None = None, offload: bool = False, activation_checkpointing: bool = False,
          reshard_after_forward: bool | int = True) -> nn.Module:
    """Shard a vexact-models causal LM with FSDP2, in place; returns it (now an ``FSDPModule``).

    Applies ``fully_shard`` to every decoder layer (``model.model.layers[i]``) and then to the
    whole model (embeddings, final norm and LM head, tied or not, form the root's group), and
    registers `FORWARD_METHODS` (``token_logprobs``) as forward methods.

    Args:
        model: a training-variant model (any registered architecture), unsharded; or a
            ``PeftModel`` over one (LoRA): the model under PEFT is sharded (its decoder layers,
            then it as the root: ``peft_model.token_logprobs`` runs its hooks) and the
            ``PeftModel``, which holds no parameters of its own, is returned.
        mesh: a 1-D ``DeviceMesh`` (default: all ranks of the default process group, on the
            model's device type; CUDA for a meta-device model).
        mp_policy: an FSDP ``MixedPrecisionPolicy``; or give `param_dtype` / `reduce_dtype`.
            Its ``cast_forward_inputs`` is turned off: FSDP would round the layers' fp32 RoPE
            tables and a per-sequence temperature tensor to ``param_dtype`` (the engine does
            not), so the logprobs would no longer match. With ``param_dtype=bf16`` over fp32
            parameters the forward sees exactly ``param.to(bf16)``: the rollout engine must
            hold those bf16 weights (``stream_full_weights(model, dtype=torch.bfloat16)``).
        offload: keep the sharded parameters, gradients and optimizer state on the CPU
            (``CPUOffloadPolicy``); the forward all-gathers them to the device.
        activation_checkpointing: recompute each decoder layer in the backward (HF's
            ``activation_checkpointing_enable``); values and gradients are unchanged.
        reshard_after_forward: FSDP's option for the layers (the root keeps FSDP's default).

    Raises:
        ValueError: not a model with decoder layers, already sharded, or conflicting or
            invalid precision arguments (nothing is changed).
        RuntimeError: no `mesh` and torch.distributed is not initialised.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        shard(model.get_base_model(), mesh, mp_policy=mp_policy, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
              offload=offload, activation_checkpointing=activation_checkpointing,
              reshard_after_forward=reshard_after_forward)
        return model
    layers = _decoder_layers(model)
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in layers):
        raise ValueError(f"shard: model {type(model).__name__} is already sharded with fully_shard")
    if not isinstance(offload, bool):
        raise ValueError(f"shard: offload={offload!r} must be a bool")
    policy = _mixed_precision(mp_policy, param_dtype, reduce_dtype)
    mesh = mesh if mesh is not None else _default_mesh(model)
    if mesh.ndim != 1:
        raise ValueError(f"shard: mesh has {mesh.ndim} dimensions; pass a 1-D mesh (HSDP: call fully_shard yourself)")
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    # Never cast forward inputs: a layer's include the fp32 RoPE tables and token_logprobs' may
    # include a per-sequence temperature tensor, which FSDP would round to param_dtype and the
    # engine never does. The hidden states already have param_dtype; ids are integers.
    policy = dataclasses.replace(policy, cast_forward_inputs=False)
    if activation_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload_policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    register_forward_methods(model)
    return model


def register_forward_methods(model: nn.Module) -> None:
    """Register `FORWARD_METHODS` of an FSDP2 root with ``register_fsdp_forward_method`` (a
    no-op for methods that `fsdp_forward_method` already makes FSDP-aware, and for models that
    are not ``FSDPModule``)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in FORWARD_METHODS:
        method = getattr(type(model), name, None)
        if method is not None and not getattr(method, "_vexact_fsdp_forward", False) and name not in vars(model):
            register_fsdp_forward_method(model, name)


# -- weights out of the shards --------------------------------------------------------------------

def checkpoint_name(name: str) -> str:
    """A parameter name without the prefixes of wrapper modules (activation checkpointing,
    ``torch.compile``, FSDP1): the HF checkpoint name the engine knows."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def _row_sharded(param) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout): gathered in buckets."""
    from torch.distributed.tensor import Shard

    return param.device_mesh.ndim == 1 and len(param.placements) == 1 and param.placements[0] == Shard(0)


def _gather_rows(params: list, dtype: torch.dtype | None, device: torch.device) -> list[torch.Tensor]:
    """Full tensors of row-sharded DTensors (one mesh, one dtype) with ONE all-gather.

    FSDP2 shards dim 0 like ``torch.chunk``: rank r holds rows ``[r*c, min((r+1)*c, n))`` with
    ``c = ceil(n / world)``. Each rank sends its shards padded to ``c`` rows, back to back.
    """
    mesh = params[0].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    out_dtype = dtype or params[0].dtype
    comm_device = _comm_device(mesh)
    rows = [-(-p.shape[0] // world) for p in params]
    sizes = [c * math.prod(p.shape[1:]) for c, p in zip(rows, params)]
    send = torch.zeros(sum(sizes), dtype=out_dtype, device=comm_device)
    offset = 0
    for p, c, size in zip(params, rows, sizes):
        local = p.to_local()
        held = max(0, min(c, p.shape[0] - rank * c))  # torch.chunk's rows for this rank
        if local.shape[0] != held:
            raise RuntimeError(f"stream_full_weights: a shard of {tuple(p.shape)} holds {local.shape[0]} rows on "
                               f"rank {rank}, expected {held} (not FSDP2's dim-0 chunking)")
        send[offset:offset + local.numel()].copy_(local.reshape(-1))  # the cast is elementwise: bitwise as on the full
        offset += size
    recv = torch.empty(world * send.numel(), dtype=out_dtype, device=comm_device)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has the old one only
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=mesh.get_group())
    per_rank = recv.view(world, -1)
    full, offset = [], 0
    for p, c, size in zip(params, rows, sizes):
        block = per_rank[:, offset:offset + size].reshape(world * c, *p.shape[1:])[:p.shape[0]]
        full.append(block.to(device))
        offset += size
    return full


def _plain(tensor, dtype, device) -> torch.Tensor:
    if isinstance(tensor, _dtensor_class()):
        tensor = tensor.full_tensor()
    return tensor.detach().to(device=device, dtype=dtype or tensor.dtype)


def stream_full_weights(model: nn.Module, bucket_bytes: int = 256 << 20, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None,
                        adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF checkpoint name, full tensor)`` for every parameter of a (sharded) model.

    Parameters are gathered from their DTensor shards a bucket at a time: consecutive FSDP2
    parameters are packed into one all-gather of about `bucket_bytes` (full size; a larger
    parameter travels alone), and only that bucket's full tensors exist at once (plus the
    gather buffers, about twice the bucket while it is being built). Never a second full copy
    of the model. Feed it to ``LLM.update_weights``, which copies each tensor as it arrives.

    Every rank of the mesh must consume the whole iterator, in step (each bucket is a
    collective). Tied weights appear once (under the first name); names carry no wrapper
    prefixes. MoE experts arrive as our parameters are: fused ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``. Parameters that are not DTensors are yielded as they are.

    Args:
        model: a model sharded with FSDP2 (or any model; plain parameters pass through).
        bucket_bytes: target bytes of full tensors per all-gather (>= 1).
        dtype: cast to this dtype (on the shards, before the gather: half the traffic for
            bf16, bitwise the same values as casting the full tensor).
        device: where the yielded tensors live (default: the gather's device).
        adapters_only: yield only the PEFT adapter tensors (each LoRA layer's ``lora_A`` /
            ``lora_B``, ``modules_to_save`` copies; `vexact_models.adapter_weights`), for the RL
            loop where only the adapters train and the engine's base stays. Their names are the
            model's (``...q_proj.lora_A.default.weight``, behind ``base_model.model.`` for a
            ``PeftModel``), which ``LLM.update_weights`` takes. A model without adapters is a
            ValueError.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"stream_full_weights: bucket_bytes={bucket_bytes!r} must be an int >= 1")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"stream_full_weights: dtype={dtype!r} is not a torch.dtype")
    if not isinstance(adapters_only, bool):
        raise ValueError(f"stream_full_weights: adapters_only={adapters_only!r} must be a bool")
    keep = None
    if adapters_only:
        keep = {id(t.param) for t in adapter_tensors(model)}
        if not keep:
            raise ValueError(f"stream_full_weights: adapters_only=True, but {type(model).__name__} holds no PEFT "
                             "adapters (no LoRA layer or modules_to_save copy)")
    return _stream(model, bucket_bytes, dtype, None if device is None else torch.device(device), keep)


def _comm_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _buckets(model, bucket_bytes: int, dtype, keep: set[int] | None = None) -> Iterator[list[tuple[str, object]]]:
    """The parameters in model order (those whose id is in `keep`, when given), grouped: runs of
    FSDP2 (row-sharded) DTensors of one mesh and dtype up to `bucket_bytes` of full size;
    anything else alone."""
    dtensor = _dtensor_class()
    bucket, held = [], 0
    for name, param in model.named_parameters():
        if keep is not None and id(param) not in keep:
            continue
        name = checkpoint_name(name)
        if not (isinstance(param, dtensor) and _row_sharded(param)):
            if bucket:
                yield bucket
            bucket, held = [], 0
            yield [(name, param)]
            continue
        size = param.numel() * (dtype or param.dtype).itemsize
        first = bucket[0][1] if bucket else None
        if bucket and (held + size > bucket_bytes or param.device_mesh != first.device_mesh
                       or param.dtype != first.dtype):
            yield bucket
            bucket, held = [], 0
        bucket.append((name, param))
        held += size
    if bucket:
        yield bucket


@torch.no_grad()  # a generator: no_grad holds while it runs, not while the caller does
def _stream(model, bucket_bytes, dtype, device, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    dtensor = _dtensor_class()
    for bucket in _buckets(model, bucket_bytes, dtype, keep):
        name, param = bucket[0]
        if len(bucket) == 1 and not (isinstance(param, dtensor) and _row_sharded(param)):
            yield name, _plain(param, dtype, device or param.device)
            continue
        params = [p for _, p in bucket]
        gathered = list(zip([n for n, _ in bucket],
                            _gather_rows(params, dtype, device or _comm_device(params[0].device_mesh))))
        del params, bucket, param
        while gathered:  # hand each tensor over and forget it: the caller decides its lifetime
            yield gathered.pop(0)


#: Where launchers put the job's process count: torchrun (and ``accelerate launch``), then the MPI
#: launchers accelerate also reads, in accelerate's order.
LAUNCHER_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launcher_world_size() -> int | None:
    """The number of processes the launcher of this job started (``torchrun``, ``accelerate
    launch``, mpirun), read from `LAUNCHER_WORLD_SIZE_VARS`; ``None`` when no launcher started this
    process (a plain ``python script.py``). Lets a script that needs ranks refuse with usage before
    it builds anything, instead of failing in ``init_process_group``. Raises ValueError naming the
    variable when its value is not a positive integer."""
    for name in LAUNCHER_WORLD_SIZE_VARS:
        if name in os.environ:
            value = os.environ[name]
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"launcher_world_size: {name}={value!r} must be a positive integer")
            return int(value)
    return None


def exit_rank(code: int) -> NoReturn:
    """End this process (one rank of a ``torchrun`` job) with exit status `code`, skipping the
    interpreter's teardown.

    Call it last, once every rank is done with its collectives: it destroys the process groups
    if they are still up, flushes stdout and stderr, and leaves with ``os._exit``.

    Why not ``sys.exit``: after FSDP2 the gloo process group outlives ``destroy_process_group``.
    DTensor's sharding cache (a torch global) keeps the device mesh, and the mesh keeps the group,
    so its worker threads run on into interpreter finalization. There they can abort a rank
    ("terminate called without an active exception", SIGABRT) after a run that succeeded. This
    happened in CI on a loaded host. With no teardown, the rank exits with its own status.
    """
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        raise ValueError(f"exit_rank: code must be an int exit status in 0..255, got {code!r}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
