"""KernelSwitch: a user's choice between kernels for one op, from an environment variable or an
in-process override (which wins), read at every call so that a change between steps takes
effect. The attention forward (`attention_forward_choice.py`) and backward
(`attention_backward_choice.py`) choices are two of them; every ``VEXACT_*`` variable is one.

Each switch records itself on construction, with the module that declared it, so that
`KernelSwitch.declared` lists every switch imported so far: ``vexact env`` imports the modules
that declare one (`vexact_models.switches`) and prints them all, and ``docs/switches.md`` is
tested against the same list, so a new switch needs no edit in either place.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: every switch constructed so far, by environment variable (`KernelSwitch.declared`)
_DECLARED: dict[str, KernelSwitch] = {}


class KernelSwitch:
    """`modes` are the accepted names (`default` among them); `label` names the choice in errors.
    `module` is the name of the module that declared it (the caller's, by default)."""

    def __init__(self, env_var: str, modes: tuple[str, ...], default: str, label: str, module: str | None = None) -> None:
        if default not in modes:
            raise ValueError(f"KernelSwitch: default {default!r} is not one of {modes}")
        module = module if module is not None else sys._getframe(1).f_globals.get("__name__", "")
        earlier = _DECLARED.get(env_var)
        if earlier is not None and earlier.module != module:
            raise ValueError(f"KernelSwitch: {env_var} is declared in {earlier.module} already; "
                             f"{module} declares it again")
        self.env_var, self.modes, self.default, self.label, self.module = env_var, modes, default, label, module
        self._override: str | None = None
        _DECLARED[env_var] = self  # a module imported again replaces its own

    @staticmethod
    def declared() -> list[KernelSwitch]:
        """Every switch constructed so far in this process, by environment variable name (only
        those of imported modules: `vexact_models.switches.declared_switches` imports them all)."""
        return [_DECLARED[name] for name in sorted(_DECLARED)]

    def check(self, mode: str, source: str) -> str:
        """`mode`, or a ValueError naming `source`, the value and the accepted modes."""
        if mode not in self.modes:
            article = "an" if self.label[:1].lower() in "aeiou" else "a"
            raise ValueError(f"{source}={mode!r} is not {article} {self.label}; choose one of {self.modes}")
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
