"""How transformers is patched: Auto class mappings (checkpoint names follow HF exactly), and what
differs between the supported transformers releases (`compat`: 5.2 to the newest)."""

from .auto import is_patched, patch, unpatch
from .compat import HFCompatMixin

__all__ = ["HFCompatMixin", "is_patched", "patch", "unpatch"]
