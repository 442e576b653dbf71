"""Optional Triton import: the package imports (and the reference backend runs) without it."""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAS_TRITON = True
except ImportError:  # CPU-only install: kernels are defined but never launched
    HAS_TRITON = False

    class OutOfResources(Exception):  # never raised without triton
        pass

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=None)
    tl = types.SimpleNamespace(constexpr=int)


def require_triton(op: str) -> None:
    """Raise a clear error when the triton backend is chosen but triton is not installed."""
    if not HAS_TRITON:
        raise ImportError(f"{op}: backend 'triton' needs the triton package (pip install 'vexact-models[gpu]')")


_SM_COUNT: dict[int, int] = {}


#: shared memory per block (opt-in) from which five pipeline stages of a decode tile fit: Hopper's
#: 227 KB does, an A100's 163 KB does not (five 64-key K and V blocks of head dim 128: 160 KB)
DEEP_PIPELINE_SHARED_MEMORY = 200 * 1024
_DEEP: dict[int, bool] = {}


def deep_pipeline(device) -> bool:
    """Whether the CUDA `device` holds `DEEP_PIPELINE_SHARED_MEMORY` per block (cached per
    device index); False for other devices and where torch does not report it."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEEP:
        optin = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        _DEEP[index] = optin >= DEEP_PIPELINE_SHARED_MEMORY
    return _DEEP[index]


def num_sms(device) -> int:
    """Streaming multiprocessors of the CUDA `device` (cached per device index); 1 for other
    devices (the interpreter on CPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_UNVERIFIED: dict[tuple, str | None] = {}


def unverified_gpu_reason(device, majors: tuple[int, ...], what: str) -> str | None:
    """Why `what` is not verified on the CUDA `device` (its compute capability major is not one
    of `majors`), or None when it is; cached per device. Used by the optional kernels whose
    alignment was checked on some GPU generations only."""
    import torch

    device = torch.device(device)
    key = (device, majors, what)
    if key not in _UNVERIFIED:
        major, minor = torch.cuda.get_device_capability(device)
        _UNVERIFIED[key] = None if major in majors else (
            f"GPU capability {major}.{minor}: {what} is verified on capability "
            f"{', '.join(f'{m}.x' for m in majors)} (Hopper) only")
    return _UNVERIFIED[key]


def has_tma(device) -> bool:
    """Whether `device` is a CUDA GPU with TMA (tensor memory accelerator) loads: Hopper or newer."""
    import torch

    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_rows_aligned(*tensors) -> bool:
    """Whether every tensor's base address and first-dim (row) stride are 16-byte aligned, as TMA
    tensor descriptors over them need."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def launch_warps(op: str, num_warps: int | None, default: int) -> int:
    """The warps of a launch whose caller may choose them (benchmarks sweeping launch shapes):
    `default` when `num_warps` is None, else `num_warps` if Triton takes it (1, 2, 4 or 8)."""
    warps = default if num_warps is None else num_warps
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"{op}: num_warps={warps} must be 1, 2, 4 or 8")
    return warps


_ONE_STAGE: set = set()  # launch keys whose tiles need one stage on this process's GPUs


def launch_staged(kernel, grid, args: tuple, kwargs: dict, num_stages: int, key: tuple, *, fp_fusion: bool,
                  fallback: bool = True) -> None:
    """``kernel[grid](*args, **kwargs, num_stages=num_stages, enable_fp_fusion=fp_fusion)``, or with one stage where the GPU's
    shared memory cannot hold more: the attention tiles were tuned on Hopper (228 KB per SM); an
    A100 has 164 KB, smaller GPUs about 100 KB. Pipeline stages overlap the next tile's loads with
    this tile's math and leave each output element's arithmetic unchanged (docs/design.md rule 2;
    the H200 sweep found 1, 2 and 3 stages bitwise equal), so the fallback costs speed, not bits.
    `key` names the compiled configuration and device; a fallback is remembered for it, so later
    launches (and CUDA graph captures) go straight to one stage. With ``fallback=False`` (a
    sweep's explicit candidate) the launch runs as given or raises. `fp_fusion`: whether the
    compiler may contract a product and a sum into an FMA, stated by every launch (docs/design.md
    section 4), not left to Triton's default."""
    if not fallback:
        kernel[grid](*args, **kwargs, num_stages=num_stages, enable_fp_fusion=fp_fusion)
        return
    if num_stages > 1 and key not in _ONE_STAGE:
        try:
            kernel[grid](*args, **kwargs, num_stages=num_stages, enable_fp_fusion=fp_fusion)
            return
        except OutOfResources:
            _ONE_STAGE.add(key)
    kernel[grid](*args, **kwargs, num_stages=1, enable_fp_fusion=fp_fusion)
