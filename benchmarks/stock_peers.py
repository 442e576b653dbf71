"""Stock transformers as the benchmarks' peer: one big model on the GPU at a time, and the
gated-DeltaNet hybrids' stock kernel path (transformers' torch path or fla's kernels).

- `stock_alone`: stock's twin of our model on the GPU while ours waits in host memory (two 35B
  models, or one and stock's gradients, do not fit an H200 together).
- `stock_linear_attention`: which gated delta rule stock's hybrids (Qwen3.5, Qwen3.5-MoE,
  Qwen3-Next) run. transformers binds its ``torch_chunk_gated_delta_rule`` (and the recurrent
  one) to the ``flash-linear-attention`` package's kernels at import when ``fla`` is importable,
  as real training stacks install it; ``torch`` puts back the torch path for the duration, as
  tests/models/test_gated_deltanet_models.py's ``stock_torch_path`` fixture does; ``fla`` checks
  that fla's kernels are what stock runs and says why not (`StockPathUnavailable`) otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import sys

import torch

from bench_utils import stock_attention

#: the functions stock's gated-DeltaNet layers call, which transformers binds to fla's kernels (or a
#: hub kernel) at import when those are installed
STOCK_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                          "causal_conv1d_update")
#: the stock gated delta rule paths `stock_linear_attention` takes
LINEAR_ATTENTION_PATHS = ("torch", "fla")


def free(device: torch.device) -> None:
    """Collect garbage and give the CUDA allocator's unused memory back (a no-op off CUDA's cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def stock_alone(arch, model, device: torch.device):
    """Within: stock transformers' model of `arch` (`bench_utils.stock_attention`) on `model`'s
    weights on `device`, with `model` itself in host memory meanwhile (two 21B-35B models would
    leave no room on an H200 for stock's activations or its gradients); `model` back on `device`
    after."""
    from vexact_models.conformance.models import hf_twin

    dtype = next(model.parameters()).dtype
    model.to("cpu")  # first: never both on the device, not even while the twin loads
    free(device)
    hf = None
    try:
        hf = hf_twin(arch, model, device=device, dtype=dtype, attn_implementation=stock_attention(arch),
                     stock_experts=True)
        yield hf
    finally:
        if hf is not None:
            hf.to("meta")  # its memory back now, whoever still holds the module
        free(device)
        model.to(device)


class StockPathUnavailable(RuntimeError):
    """The stock gated delta rule path asked for cannot run here (fla not installed, or not what
    transformers bound); the message says why, for the benchmark's row."""


def is_hybrid(arch) -> bool:
    """Whether stock's class of `arch` has gated-DeltaNet layers (its modeling module defines
    ``torch_chunk_gated_delta_rule``)."""
    return callable(getattr(stock_module(arch), "torch_chunk_gated_delta_rule", None))


def stock_module(arch):
    """The transformers modeling module of `arch`'s stock class."""
    return sys.modules[arch.hf_class().__module__]


def bound_delta_rule(arch) -> str:
    """The qualified name of the function stock's ``torch_chunk_gated_delta_rule`` of `arch` runs
    now: fla's kernel where transformers bound it at import, else transformers' torch path."""
    fn = _function_of(stock_module(arch).torch_chunk_gated_delta_rule)
    layer = fn
    while layer is not None:  # transformers' fallback wrapper keeps its choice in its closure
        try:
            chosen = inspect.getclosurevars(layer).nonlocals.get("implementation")
        except TypeError:  # not a Python function (a partial, a builtin)
            chosen = None
        if chosen is not None:
            return f"{chosen.__module__}.{chosen.__qualname__}"
        layer = getattr(layer, "__wrapped__", None)
    base = inspect.unwrap(fn)  # `fn` is past `_function_of` already
    return f"{base.__module__}.{base.__qualname__}"


def plain_function(fn):
    """The Python function behind a stock binding `fn`: through the ``kernels`` distribution's
    function module (`_function_of`, which may route a call to a hub kernel) and every
    ``functools.wraps`` layer (transformers' fla fallback)."""
    return inspect.unwrap(_function_of(fn))


def _function_of(fn):
    """`fn`, or the function it wraps where it is the ``kernels`` distribution's function module
    (transformers >= 5.25 binds the hub-kernel functions as ``nn.Module`` s whose forward calls
    the function it closes over, ``func``)."""
    if isinstance(fn, torch.nn.Module):
        return inspect.getclosurevars(type(fn).forward).nonlocals.get("func", fn)
    return fn


@contextlib.contextmanager
def stock_linear_attention(arch, path: str):
    """Within: stock's hybrids of `arch` run the gated delta rule `path` (`LINEAR_ATTENTION_PATHS`):
    ``torch`` (transformers' torch path: the bound functions unwrapped, put back after) or ``fla``
    (fla's kernels, as transformers bound them at import). Raises `StockPathUnavailable` where
    fla is not importable or not what stock runs, ValueError for another `path` or a model
    without gated-DeltaNet layers."""
    if path not in LINEAR_ATTENTION_PATHS:
        raise ValueError(f"stock_linear_attention: path {path!r} is not one of {LINEAR_ATTENTION_PATHS}")
    if not is_hybrid(arch):
        raise ValueError(f"stock_linear_attention: {arch.name} has no gated-DeltaNet layers")
    module = stock_module(arch)
    if path == "fla":
        try:
            importlib.import_module("fla.ops.gated_delta_rule")
        except ImportError as error:
            raise StockPathUnavailable(f"not installed ({type(error).__name__}: {error})") from None
        bound = bound_delta_rule(arch)
        if not bound.startswith("fla."):
            raise StockPathUnavailable(f"not bound: stock's torch_chunk_gated_delta_rule runs {bound}")
        yield
        return
    saved = {name: getattr(module, name) for name in STOCK_KERNEL_FUNCTIONS if callable(getattr(module, name, None))}
    try:
        for name, fn in saved.items():
            setattr(module, name, plain_function(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
