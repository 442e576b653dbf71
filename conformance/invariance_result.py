"""Result: one check of the GPU kernel-invariance proof (`kernel_invariance`), which its attention
and linear checks (`attention_invariance`, `linear_invariance`) fill too: the cases and elements
compared with ``torch.equal`` and the mismatches found, zero allowed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Result:
    """The tally of one named check; `compare` adds a case."""

    name: str
    cases: int = 0
    elements: int = 0
    mismatches: int = 0
    notes: list[str] = field(default_factory=list)

    def compare(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        """Count `want`'s elements, and as mismatches those `got` differs in (all of them when
        the shapes differ), with a note naming `what`."""
        self.cases += 1
        self.elements += want.numel()
        if got.shape != want.shape or not torch.equal(got, want):
            bad = int((got != want).sum()) if got.shape == want.shape else want.numel()
            self.mismatches += bad
            self.notes.append(f"{what}: {bad} elements differ")
