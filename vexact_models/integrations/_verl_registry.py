"""Registration of the verl integration (`install` / `uninstall`): the ``rollout.name=vexact``
entries in verl's rollout and replica registries, `vexact_models.patch`, our causal LMs'
``forward`` answering verl's fused-kernel call, and verl's fused-kernel monkey patch leaving that
forward alone. Kept apart from, and below, the rollout classes
(`vexact_models.integrations.verl`), which call `install` on import with their replica class.
"""

from __future__ import annotations

from verl.models.transformers import monkey_patch as verl_monkey_patch
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

import vexact_models
from vexact_models.integrations._verl_support import verl_forward as _verl_forward

#: ``actor_rollout_ref.rollout.name`` of this backend
ROLLOUT_NAME = "vexact"


_installed: dict[str, object] = {}


def _guarded_patch_forward(original):
    def patch_forward_with_backends(model, *args, **kwargs):
        if getattr(type(model).forward, "_vexact_verl_original", None) is not None:
            return None  # our forward already serves verl's fused-kernel path: keep it
        return original(model, *args, **kwargs)

    patch_forward_with_backends._vexact_verl_original = original
    return patch_forward_with_backends


def install(replica_class: type) -> None:
    """Register the backend and the hook with verl (idempotent; `vexact_models.integrations.verl`
    calls it on import, with its `VexactReplica` as `replica_class`): ``rollout.name=vexact`` in
    verl's rollout and replica registries, `vexact_models.patch` (verl loads our classes), our
    causal LMs' ``forward`` answering verl's fused-kernel call, and verl's fused-kernel monkey
    patch leaving that forward alone."""
    if _installed:
        return

    def replica_loader() -> type:  # verl's replica registry takes a loader of the class
        return replica_class

    _installed["was_patched"] = vexact_models.is_patched()
    vexact_models.patch()
    verl_rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "vexact_models.integrations.verl.VexactRollout"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, replica_loader)
    wrapped = []
    for arch in vexact_models.architectures():
        cls = arch.causal_lm_class
        if getattr(cls.forward, "_vexact_verl_original", None) is None:
            wrapped.append((cls, cls.__dict__.get("forward")))
            cls.forward = _verl_forward(cls.forward)
    _installed["forwards"] = wrapped
    verl_monkey_patch.patch_forward_with_backends = _guarded_patch_forward(verl_monkey_patch.patch_forward_with_backends)


def uninstall() -> None:
    """Undo `install` exactly (for tests, or to compare with verl's stock path)."""
    if not _installed:
        return
    verl_rollout_base._ROLLOUT_REGISTRY.pop((ROLLOUT_NAME, "async"), None)
    RolloutReplicaRegistry._registry.pop(ROLLOUT_NAME, None)
    for cls, own in reversed(_installed["forwards"]):
        if own is None:
            del cls.forward
        else:
            cls.forward = own
    guarded = verl_monkey_patch.patch_forward_with_backends
    verl_monkey_patch.patch_forward_with_backends = getattr(guarded, "_vexact_verl_original", guarded)
    if not _installed["was_patched"]:
        vexact_models.unpatch()
    _installed.clear()

