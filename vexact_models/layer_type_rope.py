"""RoPE tables per attention layer type: ``config.rope_parameters`` keyed by ``config.layer_types``
(``{"sliding_attention": {...}, "full_attention": {...}}``), as transformers gives them to Gemma 3
(local and global bases) and OLMo 3 (YaRN on the full-attention layers only)."""

from __future__ import annotations

import copy

import torch

from vexact_models.layers import RopeTables

__all__ = ["LayerTypeRope"]


class LayerTypeRope:
    """One `RopeTables` per layer type (``config.rope_parameters[layer_type]``); `get` gives
    ``{layer_type: (cos, sin)}`` and each attention layer takes its own."""

    def __init__(self, config, head_dim: int) -> None:
        self.tables = {}
        for kind in sorted(set(config.layer_types)):
            params = (config.rope_parameters or {}).get(kind)
            if params is None:
                raise ValueError(f"{type(config).__name__}: rope_parameters has no entry for layer type {kind!r}")
            view = copy.copy(config)
            view.rope_parameters = dict(params)
            self.tables[kind] = RopeTables(view, head_dim)

    @property
    def max_positions(self) -> int:
        """The positions every table covers now (they grow together, `ensure`)."""
        return min(table.max_positions for table in self.tables.values())

    def ensure(self, positions: int) -> None:
        for table in self.tables.values():
            table.ensure(positions)

    def get(self, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table.get(device) for kind, table in self.tables.items()}
