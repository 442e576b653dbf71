"""Loading as transformers loads, for every registered architecture at every shape: a causal LM's
checkpoint into the reward-model and critic heads (``num_labels=1``, as TRL and verl build them)
and a base model's checkpoint into the causal LM get the new head weights initialised with
transformers' init and reported as transformers reports them (loading info, load report); a
missing decoder tensor is an error naming it; a mis-shaped tensor raises transformers'
exception (``RuntimeError``) naming it, and ``ignore_mismatched_sizes=True`` loads as transformers
does. Stock transformers on the same checkpoint is the reference throughout."""

import inspect
import logging
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

import vexact_models
from vexact_models.loading import CheckpointError, refuse_sharding_inside_layers
from vexact_models.registry import get

from .model_support import SHAPES, rel, saved_name, shape_id, skip_unless_stock_has, stock_model

pytestmark = pytest.mark.compat

HEADS = [("ForSequenceClassification", AutoModelForSequenceClassification),
         ("ForTokenClassification", AutoModelForTokenClassification)]
INFO_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")


@pytest.fixture(scope="module", params=SHAPES, ids=shape_id)
def causal_checkpoint(request, tmp_path_factory):
    """(architecture, shape, a stock causal LM's checkpoint with an untied head)."""
    arch, shape = request.param
    path = tmp_path_factory.mktemp(shape_id(request.param).replace(":", "-"))
    stock_model(arch, shape=shape, tie_word_embeddings=False, pad_token_id=0).save_pretrained(path)
    return arch, shape, path


class Report(logging.Handler):
    """transformers' load report: the warnings of ``transformers.modeling_utils``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers.modeling_utils").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("transformers.modeling_utils").removeHandler(self)


def load(auto, path, ours: bool, seed: int = 0, **kwargs):
    """``auto.from_pretrained(path, output_loading_info=True, **kwargs)`` with our classes (after
    `patch()`) or stock ones, from the same seed; (model, loading info, load report lines)."""
    (vexact_models.patch if ours else vexact_models.unpatch)()
    try:
        torch.manual_seed(seed)
        with Report() as report:
            model, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kwargs)
    finally:
        vexact_models.unpatch()
    assert type(model).__module__.startswith("vexact_models") == ours, type(model)
    return model, info, report.lines


def same_info(a: dict, b: dict) -> bool:
    return all(set(a[k]) == set(b[k]) for k in INFO_KEYS)


def corrupt(path, out, edit):
    """A copy of the checkpoint at `path` with its tensors edited by `edit(tensors)`."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("head, auto", HEADS, ids=[h for h, _ in HEADS])
def test_heads_from_a_causal_lm_checkpoint_load_as_stock(causal_checkpoint, head, auto):
    """verl's critic (token classification) and TRL's reward model (sequence classification):
    the decoder from the checkpoint, a new ``score`` with transformers' init (the very values
    stock draws from the same seed), reported as missing in the info and the load report."""
    arch, _, path = causal_checkpoint
    skip_unless_stock_has(arch, head)
    ours, info, report = load(auto, path, ours=True, num_labels=1)
    stock, stock_info, _ = load(auto, path, ours=False, num_labels=1)
    assert same_info(info, stock_info), (info, stock_info)
    assert "score.weight" in info["missing_keys"] and "lm_head.weight" in info["unexpected_keys"]
    assert any("score.weight" in line and "MISSING" in line for line in report), report
    want = stock.state_dict()
    got = ours.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), arch.name
    ids = torch.randint(1, 512, (2, 7))
    with torch.no_grad():
        assert rel(ours(ids).logits, stock(ids).logits) <= 1e-5


def test_base_model_checkpoint_loads_into_the_causal_lm_with_a_new_head(causal_checkpoint, tmp_path):
    """transformers' ``test_base_model_prefix_loads_base_weights`` / ``test_correct_missing_keys``:
    a base model's checkpoint (no ``model.`` prefix, no ``lm_head``) loads into ``*ForCausalLM``
    with the decoder's weights and a newly initialised ``lm_head``, reported as missing."""
    arch, shape, _ = causal_checkpoint
    stock_model(arch, "Model", shape=shape, tie_word_embeddings=False).save_pretrained(tmp_path)
    ours, info, report = load(AutoModelForCausalLM, tmp_path, ours=True)
    stock, stock_info, _ = load(AutoModelForCausalLM, tmp_path, ours=False)
    assert same_info(info, stock_info) and set(info["missing_keys"]) == {"lm_head.weight"}, (info, stock_info)
    assert any("lm_head.weight" in line for line in report), report
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("auto", [AutoModelForCausalLM, AutoModelForTokenClassification], ids=lambda a: a.__name__)
def test_a_missing_decoder_tensor_is_an_error_naming_it(causal_checkpoint, auto, tmp_path):
    """What transformers would initialise randomly with a warning: a decoder weight."""
    _, _, path = causal_checkpoint
    broken = corrupt(path, tmp_path / "ckpt", lambda t: t.pop(saved_name(t, "model.norm.weight")))
    vexact_models.patch()
    try:
        with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model\.norm\.weight'\]") as info:
            auto.from_pretrained(broken, num_labels=1)
    finally:
        vexact_models.unpatch()
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_a_misshaped_tensor_raises_transformers_exception_naming_it(causal_checkpoint, tmp_path):
    """Without ``ignore_mismatched_sizes`` stock raises RuntimeError (pointing at its report);
    ours raises a RuntimeError naming the tensor and both shapes. With it, both load, the
    tensor newly initialised and reported in ``mismatched_keys``."""
    arch, _, path = causal_checkpoint
    hidden = arch.tiny_config().hidden_size

    def widen(tensors):
        tensors[saved_name(tensors, "model.norm.weight")] = torch.full((hidden + 2,), 3.0)

    broken = corrupt(path, tmp_path / "ckpt", widen)
    with pytest.raises(RuntimeError):
        load(AutoModelForCausalLM, broken, ours=False)
    with pytest.raises(RuntimeError, match=rf"model\.norm\.weight has shape \({hidden + 2},\) but the model expects "
                                           rf"\({hidden},\)"):
        load(AutoModelForCausalLM, broken, ours=True)
    ours, info, _ = load(AutoModelForCausalLM, broken, ours=True, ignore_mismatched_sizes=True)
    stock, stock_info, _ = load(AutoModelForCausalLM, broken, ours=False, ignore_mismatched_sizes=True)
    assert same_info(info, stock_info) and [k for k, *_ in info["mismatched_keys"]] == ["model.norm.weight"]
    assert torch.equal(ours.model.norm.weight, stock.model.norm.weight)  # newly initialised, not the checkpoint's
    assert not torch.equal(ours.model.norm.weight, torch.full((hidden,), 3.0))


@pytest.mark.parametrize("head, auto", HEADS, ids=[h for h, _ in HEADS])
def test_a_head_with_other_labels_loads_ignoring_mismatched_sizes(causal_checkpoint, head, auto, tmp_path):
    """transformers' ``test_can_load_ignoring_mismatched_shapes``: a 3-label head's checkpoint
    loaded with 5 labels is an error naming ``score.weight``; with
    ``ignore_mismatched_sizes=True`` the score is new, and reported as stock reports it."""
    arch, shape, _ = causal_checkpoint
    skip_unless_stock_has(arch, head)
    stock_model(arch, head, shape=shape, num_labels=3, pad_token_id=0).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match=r"score\.weight has shape \(3, "):
        load(auto, tmp_path, ours=True, num_labels=5)
    ours, info, _ = load(auto, tmp_path, ours=True, num_labels=5, ignore_mismatched_sizes=True)
    stock, stock_info, _ = load(auto, tmp_path, ours=False, num_labels=5, ignore_mismatched_sizes=True)
    assert same_info(info, stock_info) and "score.weight" in {k for k, *_ in info["mismatched_keys"]}
    assert ours.score.weight.shape[0] == 5 and torch.equal(ours.score.weight, stock.score.weight)


def _sharding_requests() -> list:
    """``from_pretrained`` arguments that ask for sharding inside the layers, as the installed
    transformers takes them: ``DistributedConfig`` from 5.17 on, whose fields vary by release
    (``ep_size`` from 5.18; 5.25 turns ``enable_expert_parallel`` alone into a plan of nothing),
    so a field is tried where the release has it and keeps the request."""
    requests = [pytest.param({"tp_plan": "auto"}, id="tp_plan"), pytest.param({"tp_size": 2}, id="tp_size")]
    distributed = getattr(transformers, "DistributedConfig", None)
    fields = inspect.signature(distributed).parameters if distributed is not None else {}
    for field, value, extra in (("tp_size", 2, {}), ("ep_size", 2, {"fsdp_size": 2}),
                                ("enable_expert_parallel", True, {}), ("enable_sequence_parallel", True, {})):
        if field in fields and all(key in fields for key in extra):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                config = distributed(**{field: value}, **extra)
            if getattr(config, field) == value:
                requests.append(pytest.param({"distributed_config": config}, id=f"distributed_config.{field}"))
    return requests


@pytest.mark.parametrize("kwargs", _sharding_requests())
def test_tensor_or_expert_parallel_loading_is_refused_before_anything_loads(kwargs, tmp_path):
    """transformers' tensor / expert / sequence parallelism turns the layers' weights into
    DTensors, on which the aligned forward failed with torch's "mixed torch.Tensor and DTensor":
    refused by the argument's name, through `patch()`'s Auto class too, before any process group
    is needed. A request for nothing (``tp_plan=None``, ``tp_size=1``, an empty plan) loads."""
    arch = get("qwen3")
    arch.hf_class()(arch.tiny_config()).save_pretrained(tmp_path)
    key, value = next(iter(kwargs.items()))
    vexact_models.patch()
    try:
        with pytest.raises(ValueError, match=f"from_pretrained: {key}.* asks transformers to shard weights inside"):
            AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)
        assert type(AutoModelForCausalLM.from_pretrained(tmp_path, tp_plan=None)) is arch.causal_lm_class
    finally:
        vexact_models.unpatch()
    refuse_sharding_inside_layers("Qwen3ForCausalLM", {"tp_plan": {}, "tp_size": 1, "distributed_config": None})
