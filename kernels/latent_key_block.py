"""The key block of every latent MLA launch: the KV reduction's block size, hence its order
(docs/design.md rule 2). The Triton launches (`latent_attention`) and the Gluon ones
(`latent_decode_gluon`, `latent_prefill_gluon`) all read it here, so that the reduction order is
one value per dtype whichever kernel runs."""

from __future__ import annotations

import torch


def key_block(dtype: torch.dtype) -> int:
    """Keys per block, the KV reduction order: one per dtype (fp32's tiles are smaller)."""
    return 16 if dtype == torch.float32 else 64
