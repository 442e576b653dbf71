"""No module that FSDP2 shards on its own returns a view: not the causal LM, its base model, a
decoder layer or the final norm. FSDP2 hooks its pre-backward all-gather onto a sharded module's
outputs; on a view, an in-place op downstream (``logits.div_(temperature)``, as RL trainers
write) drops that hook, and torch 2.13 warns for every such output (docs/fsdp.md)."""

import pytest
import torch

from .model_support import SHAPES, shape_id


def outputs_that_are_views(model: torch.nn.Module, modules: dict[str, torch.nn.Module], **inputs) -> list[str]:
    """``name[i]`` for each grad-requiring tensor output of `modules` (name -> module) that is a
    view, in a training forward of `model` on `inputs` (the check FSDP2 makes: ``t._base``)."""
    found = []

    def hook(name):
        def check(module, args, output):
            tensors = output.to_tuple() if hasattr(output, "to_tuple") else output
            for i, t in enumerate(tensors if isinstance(tensors, tuple) else (tensors,)):
                if torch.is_tensor(t) and t.requires_grad and t._base is not None:
                    found.append(f"{name}[{i}]")
        return check

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    try:
        model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_sharded_modules_return_no_views(case):
    arch, shape = case
    torch.manual_seed(0)
    model = arch.causal_lm_class(shape.tiny_config()).train()
    base = model.model
    modules = {"causal_lm": model, "model": base, "norm": base.norm,
               **{f"layers.{i}": layer for i, layer in enumerate(base.layers)}}
    ids = torch.randint(1, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the padded path's scatter
    assert outputs_that_are_views(model, modules, input_ids=ids) == []
    assert outputs_that_are_views(model, modules, input_ids=ids, attention_mask=mask, labels=ids) == []
