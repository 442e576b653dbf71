"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU, and read their resources.

`compile_only()` swaps Triton's active driver for one that reports an sm_90 target and turns every
kernel launch into a compile: the launchers of `vexact_models.kernels` run as they would on an
H100/H200 (their specialisation, their constexprs, their TMA descriptors), on CPU tensors, and
nothing runs. `resources(kernel)` then runs the wheel's own ``ptxas -v`` on the kernel's PTX:
registers per thread, spill bytes, shared memory and which MMA instructions the dots became; and
``nvdisasm`` on the cubin: the SASS instructions of its longest loop (`largest_loop`), for the
GQA decode launch exactly the 801 a warp executed per key block under ncu on the H200.

Why: a decode kernel's speed on Hopper hangs on these numbers (a 16-row latent tile's query
operand in every warp's registers took 255 registers and spilled, one program per SM;
ptxas and ncu on the H200, 2026-11-27), and GPU time is short. They can be read here
first, and only the candidates worth it timed there. Registers and spills are ptxas's for sm_90a,
as the GPU's own compile gets them (the driver's count can differ by a few registers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

import torch


class _Sm90CompileOnly:
    """Triton's driver interface, as much of it as a compile needs: an sm_90 target, device 0."""

    def __init__(self) -> None:
        self.compiled: list = []

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_only() -> Iterator[list]:
    """Inside the block, a Triton launch compiles for sm_90 and returns without running; the list
    it yields receives each compiled kernel, in launch order. Triton's driver and launch path are
    restored on exit. (Kernels compiled here stay in their JIT cache under device 0: run this in a
    process that launches nothing on a real GPU.)"""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    fake = _Sm90CompileOnly()
    launch = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        fake.compiled.append(kernel)
        return kernel

    previous = driver._active  # None until something asked for it: left lazy again on exit
    driver.set_active(fake)
    JITFunction.run = compile_instead
    try:
        yield fake.compiled
    finally:
        JITFunction.run = launch
        driver.set_active(previous)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel asks of an SM."""

    name: str
    registers: int  # per thread
    spill_bytes: int  # spill stores + loads, per thread
    shared_bytes: int
    num_warps: int
    wgmma: int  # wgmma.mma_async instructions in the PTX
    mma_sync: int  # mma.sync instructions
    loop_instructions: int = 0  # SASS instructions in the longest loop (`largest_loop`)

    def programs_per_sm(self, registers_per_sm: int = 65536, shared_per_sm: int = 227 * 1024) -> int:
        """Resident programs an SM can hold, by registers and by shared memory (Hopper's limits)."""
        by_regs = registers_per_sm // (self.registers * 32 * self.num_warps)
        by_smem = shared_per_sm // self.shared_bytes if self.shared_bytes else by_regs
        return min(by_regs, by_smem)

    @property
    def mma(self) -> str:
        """The dots' instructions: "wgmma", "mma.sync", both or none."""
        kinds = [k for k, n in (("wgmma", self.wgmma), ("mma.sync", self.mma_sync)) if n]
        return "+".join(kinds) or "none"


def sm90_tools() -> tuple[str, str]:
    """``(ptxas, nvdisasm)``: the paths of the tools Triton's own NVIDIA backend runs for sm_90,
    so that ptxas accepts the PTX version Triton wrote for it. Triton 3.6 compiles Hopper with the
    wheel's ``ptxas`` (CUDA 12.8); Triton 3.9 with ``ptxas-blackwell`` (CUDA 13.4), whose PTX 9.4
    the older one refuses. ``TRITON_PTXAS_PATH`` and Triton's other tool overrides apply."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path, knobs.nvidia.nvdisasm.path


def resources(kernel) -> KernelResources:
    """`kernel` (one of `compile_only`'s) through ``ptxas -v -arch=sm_90a``, its SASS through
    ``nvdisasm`` (the tools Triton compiles sm_90 with: `sm90_tools`)."""
    ptx = kernel.asm["ptx"]
    ptxas, nvdisasm = sm90_tools()
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"ptxas failed on {kernel.name}: {run.stderr[-2000:]}")
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register or spill counts for {kernel.name}: {run.stderr[-2000:]}")
    return KernelResources(kernel.name, int(registers.group(1)), int(spills.group(1)) + int(spills.group(2)),
                           kernel.metadata.shared, kernel.metadata.num_warps, ptx.count("wgmma.mma_async"),
                           ptx.count("mma.sync"), largest_loop(sass))


def largest_loop(sass: str) -> int:
    """SASS instructions in the longest loop of ``nvdisasm -c`` output (from a backward branch's
    target to the branch): what a warp issues per iteration of a kernel's key-block loop. A
    decode program's time at short contexts follows it (ncu on the H200, 2026-11-28)."""
    start = {}  # label -> index of the instruction after it
    instructions = []  # instruction texts, in address order
    label = None
    for line in sass.splitlines():
        found = re.match(r"\s*\.(L_x_\d+):", line)
        if found:
            label = found.group(1)
            continue
        found = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if found:
            if label is not None:
                start[label], label = len(instructions), None
            instructions.append(found.group(1))
    longest = 0
    for at, text in enumerate(instructions):
        branch = re.search(r"\bBRA\b.*?`?\(?\.(L_x_\d+)", text)
        if branch and start.get(branch.group(1), at + 1) <= at:  # a backward branch: its body is a loop
            longest = max(longest, at - start[branch.group(1)] + 1)
    return longest


def fused_lines(ptx: str) -> set[tuple[str, int]]:
    """The source lines, as (file name, line), whose operations the PTX computes with fused
    multiply-adds (each ``fma.rn`` under the ``.loc`` before it; line 0 for code the compiler made
    itself). Where contraction is on, the compiler fuses a product into an add where the register
    layout lets it, and the layout follows the launch's tile: a kernel whose launch shapes must give
    the same bits should fuse the same lines under each (the GDN walk's shapes once did not:
    docs/design.md section 6b)."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, flags=re.M))
    where, found = None, set()
    for line in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s", line)
        if loc:
            where = (os.path.basename(files.get(loc.group(1), loc.group(1))), int(loc.group(2)))
        elif re.match(r"\s*fma\.rn", line) and where is not None:
            found.add(where)
    return found
