"""Aligned ops: batch-invariant kernels with a Triton (GPU) and a reference (CPU) backend.

Each op lives in its own module with its Triton kernel, launcher, reference implementation,
backward (where training needs one) and a docstring stating its invariance contract.
"""

from .attention import PagedLayout, attention, attention_packed, packed_layout
from .backend import BACKENDS, UnsupportedError, current_backend, set_backend, use_backend
from .kv_cache_write import kv_cache_write
from .linear import linear
from .log_softmax import gather_logprobs, log_softmax
from .rms_norm import add_rms_norm, rms_norm
from .rotary import apply_rotary, rope_table
from .sampling import sample_tokens
from .silu_and_mul import silu_and_mul
from .token_logprobs import token_logprobs

__all__ = [
    "BACKENDS", "PagedLayout", "UnsupportedError", "add_rms_norm", "apply_rotary", "attention", "attention_packed",
    "current_backend", "gather_logprobs", "kv_cache_write", "linear", "log_softmax", "packed_layout",
    "rms_norm", "rope_table", "sample_tokens", "set_backend", "silu_and_mul", "token_logprobs", "use_backend",
]
