"""`kernels.gluon_support`: the Triton-version gate every Gluon kernel reads, and the TMA
descriptors they take (built on the CPU: a descriptor is host data until a launch)."""

import subprocess
import sys

import pytest
import torch

from vexact_models.kernels import attention_gluon, gluon_support, latent_decode_gluon, latent_prefill_gluon


def test_gluon_kernels_run_only_under_the_triton_they_were_checked_with():
    assert gluon_support.supported_triton("3.6.0") and gluon_support.supported_triton("3.6.1")
    assert not gluon_support.supported_triton("3.7.0") and not gluon_support.supported_triton("3.5.1")
    triton = pytest.importorskip("triton")
    assert gluon_support.HAS_GLUON == gluon_support.supported_triton(triton.__version__)
    # one gate for the three kernels
    assert latent_decode_gluon.HAS_GLUON is latent_prefill_gluon.HAS_GLUON is attention_gluon.HAS_GLUON
    assert latent_decode_gluon.HAS_GLUON is gluon_support.HAS_GLUON


@pytest.mark.skipif(not gluon_support.HAS_GLUON, reason="needs the verified Triton's Gluon")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_descriptor_covers_the_tensor_and_copies_swizzled_blocks(dtype):
    """The descriptor spans the tensor's shape and strides (a strided view included), copies
    `block` at a time into the 128-byte swizzle the warpgroup MMAs read, and shares one layout
    object per (block, dtype) so that eager launches do not rebuild it."""
    fused = torch.zeros(300, 3, 128, dtype=dtype)
    v = fused[:, 2].reshape(300, 128)  # a strided view: rows 3 x 128 apart
    desc = gluon_support.tma_descriptor(v, [64, 128])
    assert desc.shape == [300, 128] and desc.strides == [384, 1] and desc.block_shape == [64, 128]
    assert desc.layout.swizzle_byte_width == 128 and desc.layout.element_bitwidth == 16
    assert gluon_support.tma_descriptor(fused[:, 0], [64, 128]).layout is desc.layout
    assert gluon_support.tma_descriptor(v, [16, 64]).layout is not desc.layout


def test_the_kernels_import_without_triton():
    """Where triton is missing (the compat venvs, a CPU install) the package and the Gluon kernels'
    modules still import, with the gate closed: nothing Gluon-only may sit outside their Gluon
    blocks."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from vexact_models.kernels import (attention_gluon, attention_gluon_consumer, gluon_support,\n"
            "                                   latent_decode_gluon, latent_prefill_gluon)\n"
            "assert not gluon_support.HAS_GLUON and not attention_gluon.HAS_GLUON\n"
            "assert not hasattr(gluon_support, 'block_slot')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
