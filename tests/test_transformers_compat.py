"""patch() and attn_implementation on every supported transformers release, with the
classification Auto classes' routing (docs/design.md section 8, drop-in). CI runs this file on the
oldest supported release, 5.10.x, 5.17 and the newest (``.ci/run``, the ``compat`` marker)."""

import subprocess
import sys

import pytest
import torch
import transformers
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)

import vexact_models
from vexact_models.patches.checkpoints import expert_tensor_shapes
from vexact_models.patches.compat import HFCompatMixin, valid_attn_implementations

from .models.model_support import ARCHS, SHAPES, shape_id

pytestmark = pytest.mark.compat

#: the architectures with routed experts (they also take an experts_implementation)
MOE = sorted(name for name, arch in ARCHS.items() if expert_tensor_shapes(arch.tiny_config()) is not None)
# every kind of value HF accepts: its names, a hub kernel, and None (HF's default)
ATTN_VALUES = ["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
               "kernels-community/flash-attn", None]
AUTO_FIELDS = [(AutoModelForCausalLM, "causal_lm_class"), (AutoModel, "base_model_class"),
               (AutoModelForSequenceClassification, "sequence_classification_class"),
               (AutoModelForTokenClassification, "token_classification_class")]


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    vexact_models.unpatch()


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    """A stock transformers Qwen3 checkpoint."""
    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    ARCHS["qwen3"].hf_class()(ARCHS["qwen3"].tiny_config()).save_pretrained(path)
    return path


def resolved_classes() -> dict:
    """What every Auto class builds for every architecture's tiny config (class, body class);
    (None, None) where the Auto class has no entry (stock transformers maps no token-classification head
    to Qwen3.5's text config, for one)."""
    out = {}
    for arch in ARCHS.values():
        for auto, _ in AUTO_FIELDS:
            try:
                model = auto.from_config(arch.tiny_config())
            except ValueError:
                out[arch.name, auto.__name__] = (None, None)
                continue
            out[arch.name, auto.__name__] = (type(model), type(getattr(model, "model", None)))
    return out


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_patch_routes_every_auto_class(case):
    arch, shape = case
    vexact_models.patch()
    for auto, field in AUTO_FIELDS:
        model = auto.from_config(shape.tiny_config())
        ours = getattr(arch, field)
        if ours is not None:
            assert type(model) is ours, (auto.__name__, transformers.__version__)
        else:  # HF's head, which builds its body through AutoModel: our base model
            assert type(model.model) is arch.base_model_class, (auto.__name__, transformers.__version__)


def test_patch_routes_from_pretrained_and_unpatch_restores(qwen3_checkpoint):
    arch = ARCHS["qwen3"]
    stock = type(AutoModelForCausalLM.from_pretrained(qwen3_checkpoint))
    vexact_models.patch()
    assert type(AutoModelForCausalLM.from_pretrained(qwen3_checkpoint)) is arch.causal_lm_class
    assert type(AutoModel.from_pretrained(qwen3_checkpoint)) is arch.base_model_class
    vexact_models.unpatch()
    assert type(AutoModelForCausalLM.from_pretrained(qwen3_checkpoint)) is stock


def test_is_patched_tells_the_truth():
    assert not vexact_models.is_patched()
    vexact_models.patch()
    assert vexact_models.is_patched()
    assert all(ours is getattr(ARCHS[name], "causal_lm_class") for (name, auto), (ours, _) in resolved_classes().items()
               if auto == "AutoModelForCausalLM")
    vexact_models.unpatch()
    assert not vexact_models.is_patched()
    assert all(ours.__module__.startswith("transformers.") for (_, auto), (ours, _) in resolved_classes().items()
               if auto == "AutoModelForCausalLM")


def test_unpatch_restores_a_users_own_registration():
    """A class the user registered before patch() (through HF's public API, whatever this
    release does with it) resolves again after unpatch(), and everything else is stock again."""
    hf_class = ARCHS["qwen3"].hf_class()
    user_class = type("UserQwen3ForCausalLM", (hf_class,), {})
    AutoModelForCausalLM.register(hf_class.config_class, user_class, exist_ok=True)
    try:
        before = resolved_classes()
        vexact_models.patch()
        vexact_models.patch()  # idempotent
        assert resolved_classes() != before
        vexact_models.unpatch()
        vexact_models.unpatch()  # idempotent
        assert resolved_classes() == before
    finally:
        AutoModelForCausalLM._model_mapping._extra_content.pop(hf_class.config_class, None)


def test_every_model_class_has_the_compat_mixin():
    for arch in ARCHS.values():
        for _, field in AUTO_FIELDS:
            cls = getattr(arch, field)
            assert cls is None or issubclass(cls, HFCompatMixin), cls


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_checkpoint):
    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    finally:
        vexact_models.unpatch()
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ids, model(ids).logits


@pytest.mark.parametrize("attn", ATTN_VALUES)
def test_attn_implementation_loads_and_gives_the_same_logits(attn, qwen3_checkpoint, qwen3_reference):
    """flash-attn and the hub `kernels` package are not installed here: HF alone would raise."""
    vexact_models.patch()
    kwargs = {} if attn is None else {"attn_implementation": attn}
    model = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32, **kwargs).eval()
    assert type(model) is ARCHS["qwen3"].causal_lm_class
    expected = "sdpa" if attn is None else attn  # what HF stores (None: its default, sdpa)
    assert model.config._attn_implementation == expected
    assert model.model.config._attn_implementation == expected
    ids, logits = qwen3_reference
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_from_config_accepts_attn_and_experts_implementation_for_every_class(case):
    """Every class of every architecture at every shape, through the Auto classes HF's trainers
    use. MoE models also get an experts implementation (item 4: "does not support setting
    experts implementation"). Where the head is HF's own (no head of ours registered), HF checks
    the head's attention itself, so only values it accepts without flash-attn are passed."""
    arch, shape = case
    moe = arch.name in MOE
    vexact_models.patch()
    for auto, field in AUTO_FIELDS:
        ours = getattr(arch, field) is not None
        for attn, experts in (("flash_attention_2" if ours else "sdpa", "grouped_mm" if moe else None), (None, None)):
            kwargs = {k: v for k, v in (("attn_implementation", attn), ("experts_implementation", experts)) if v}
            model = auto.from_config(shape.tiny_config(), **kwargs)
            for module in (model, getattr(model, "model", model)):
                assert module.config._attn_implementation == (attn or "sdpa"), (auto.__name__, attn)
                assert module.config._experts_implementation in ({experts} if experts else {"eager", "grouped_mm"})


def _stock_head(arch, head: str) -> type | None:
    """transformers' own `head` class of `arch`, None where it has none (Qwen3.5-MoE's text model)."""
    try:
        return arch.hf_class(head)
    except AttributeError:
        return None


#: (MoE architecture, head) for the heads transformers has
MOE_HEADS = [(name, head) for name in MOE for head in ("ForSequenceClassification", "ForTokenClassification")
             if _stock_head(ARCHS[name], head) is not None]


@pytest.mark.parametrize("name, head", MOE_HEADS)
def test_hf_heads_build_our_moe_body(name, head):
    """HF's own head classes (built directly, not through an Auto class) set HF's experts
    implementation on the config, then build their body through AutoModel: ours after patch()."""
    arch = ARCHS[name]
    vexact_models.patch()
    model = _stock_head(arch, head)(arch.tiny_config())
    assert type(model.model) is arch.base_model_class
    ids = torch.randint(0, 512, (1, 6))
    with torch.no_grad():
        assert model(ids).logits.shape[-1] == model.config.num_labels


def test_set_attn_implementation_switches(qwen3_checkpoint, qwen3_reference):
    vexact_models.patch()
    model = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("flash_attention_2")
    assert model.config._attn_implementation == "flash_attention_2"
    ids, logits = qwen3_reference
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_unknown_attn_implementation_is_an_error_naming_it():
    arch = ARCHS["qwen3"]
    vexact_models.patch()
    with pytest.raises(ValueError, match="attn_implementation='flash_attn_9'.*'sdpa'"):
        AutoModelForCausalLM.from_config(arch.tiny_config(), attn_implementation="flash_attn_9")
    with pytest.raises(ValueError, match="experts_implementation='fastest'.*'grouped_mm'"):
        AutoModelForCausalLM.from_config(ARCHS["qwen3_moe"].tiny_config(), experts_implementation="fastest")
    assert {"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"} <= valid_attn_implementations()


_ONE_PROCESS = """
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(name)s %(message)s")
from transformers import AutoModelForCausalLM
import vexact_models
from vexact_models.registry import get
vexact_models.patch()
config = get("qwen3").tiny_config
AutoModelForCausalLM.from_config(config())  # the default is not a request: no line
print("LOG requests", file=sys.stderr, flush=True)
for attn in ("sdpa", "flash_attention_2", "eager", "sdpa"):
    AutoModelForCausalLM.from_config(config(), attn_implementation=attn)
"""


def test_log_line_once_per_process():
    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("LOG ")]
    assert lines == ["LOG requests", "LOG vexact_models vexact-models: attn_implementation='sdpa' requested; the "
                     "aligned attention kernel runs instead (bitwise equal to rollouts)"], done.stderr[-3000:]
