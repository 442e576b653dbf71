"""How transformers is patched: Auto class mappings (checkpoint names follow HF exactly)."""

from .auto import is_patched, patch, unpatch

__all__ = ["is_patched", "patch", "unpatch"]
