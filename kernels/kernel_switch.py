"""KernelSwitch: a user's choice between kernels for one op, from an environment variable or an
in-process override (which wins), read at every call so that a change between steps takes
effect. The attention forward (`attention_forward_choice.py`) and backward
(`attention_backward_choice.py`) choices are two of them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class KernelSwitch:
    """`modes` are the accepted names (`default` among them); `label` names the choice in errors."""

    def __init__(self, env_var: str, modes: tuple[str, ...], default: str, label: str) -> None:
        if default not in modes:
            raise ValueError(f"KernelSwitch: default {default!r} is not one of {modes}")
        self.env_var, self.modes, self.default, self.label = env_var, modes, default, label
        self._override: str | None = None

    def check(self, mode: str, source: str) -> str:
        """`mode`, or a ValueError naming `source`, the value and the accepted modes."""
        if mode not in self.modes:
            raise ValueError(f"{source}={mode!r} is not an {self.label}; choose one of {self.modes}")
        return mode

    def mode(self) -> str:
        """The override if set, else the environment variable, else the default."""
        if self._override is not None:
            return self._override
        return self.check(os.environ.get(self.env_var, self.default), self.env_var)

    def set(self, mode: str | None) -> None:
        """Override the environment with `mode`; None hands the choice back to it."""
        self._override = None if mode is None else self.check(mode, self.label)

    @contextlib.contextmanager
    def use(self, mode: str | None) -> Iterator[None]:
        """`set` for the duration of a ``with`` block; the previous override comes back on exit."""
        previous = self._override
        self.set(mode)
        try:
            yield
        finally:
            self._override = previous
