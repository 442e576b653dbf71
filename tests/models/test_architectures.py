"""The training variant of every registered architecture at every shape, against stock
transformers on the same weights: logits (fp32, max relative error <= the architecture's
`fp32_parity`: 1e-5, but for the gated-DeltaNet hybrids), padding, loss and gradients, hidden
states; `token_logprobs` bitwise across packing and padding, its values and temperature, autograd
and gradient checkpointing; checkpoints (stock layout in and out, strict
loading); input errors; the inference variant. A new architecture is checked here without an
edit; per-model files keep only what is specific to one model."""

import importlib
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vexact_models.gated_deltanet import GatedDeltaNet

from .model_support import (ARCHS, SHAPES, attention_layers, attention_output_name, rel, saved_name, shape_id,
                            stock_class, stock_model)

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


@pytest.fixture(scope="module", params=SHAPES, ids=shape_id)
def checkpoint(request, tmp_path_factory):
    """(architecture, a stock transformers checkpoint of the shape with random weights)."""
    arch, shape = request.param
    path = tmp_path_factory.mktemp(shape_id(request.param).replace(":", "-"))
    # initializer_range 0.1: router scores far from ties, so that expert choice is not decided by rounding
    stock_model(arch, shape=shape, initializer_range=0.1).save_pretrained(path)
    return arch, path


@pytest.fixture(scope="module")
def pair(checkpoint):
    """(architecture, stock model, our model), both loaded from `checkpoint` in fp32."""
    arch, path = checkpoint
    hf = arch.hf_class().from_pretrained(path, dtype=torch.float32).eval()
    ours = arch.causal_lm_class.from_pretrained(path, dtype=torch.float32).eval()
    return arch, hf, ours


def vocab(model) -> int:
    return model.config.vocab_size


def router_kwargs(hf) -> dict:
    """``output_router_logits=True`` where stock's forward takes it (its aux loss joins the loss)."""
    import inspect

    return {"output_router_logits": True} if "output_router_logits" in inspect.signature(hf.forward).parameters else {}


def test_logits_match_stock_fp32(pair):
    arch, hf, ours = pair
    ids = torch.randint(0, vocab(ours), (3, 37))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= arch.fp32_parity


def test_padded_logits_match_stock(pair):
    """Right padding: zeros at the padding. Left padding: each row as stock computes its sequence
    alone (our positions count from each row's first token), as a stock user runs one sequence.
    Not stock's left-padded batch: the gated-DeltaNet hybrids' torch path (docs/design.md section
    6b) counts its chunks from the padded row's start and adds the padding's log decays into each
    chunk's cumulative gate, other arithmetic than the sequence alone's."""
    arch, hf, ours = pair
    ids = torch.randint(0, vocab(ours), (3, 20))
    right = torch.ones_like(ids)
    right[1, 12:] = 0
    left = torch.ones_like(ids)
    left[0, :7] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=right).logits, hf(ids, attention_mask=right).logits
        assert rel(a[right.bool()], b[right.bool()]) <= arch.fp32_parity and torch.all(a[~right.bool()] == 0)
        a = ours(ids, attention_mask=left).logits
        for row, keep in zip(range(len(ids)), left.bool()):
            assert rel(a[row, keep], hf(ids[row, keep][None]).logits[0]) <= arch.fp32_parity, row


def test_loss_and_gradients_match_stock(pair):
    _, hf, ours = pair
    ids = torch.randint(0, vocab(ours), (2, 16))
    labels = ids.clone()
    labels[0, :4] = -100
    loss_hf = hf(ids, labels=labels, **router_kwargs(hf)).loss
    loss_ours = ours(ids, labels=labels, **router_kwargs(hf)).loss
    assert abs(float(loss_hf) - float(loss_ours)) < 1e-5
    names = [n for n, _ in hf.named_parameters()]
    g_hf = dict(zip(names, torch.autograd.grad(loss_hf, list(hf.parameters()))))
    g_ours = dict(zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(loss_ours, list(ours.parameters()))))
    assert g_hf.keys() == g_ours.keys()
    for name in names:
        assert rel(g_ours[name], g_hf[name]) < 1e-4, name


def test_base_model_hidden_states_match_stock(checkpoint):
    arch, path = checkpoint
    hf = stock_class(arch, "Model").from_pretrained(path, dtype=torch.float32).eval()
    ours = arch.base_model_class.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab(ours), (2, 11))
    with torch.no_grad():
        assert rel(ours(ids).last_hidden_state, hf(ids).last_hidden_state) <= arch.fp32_parity


def test_token_logprobs_bitwise_across_packing_and_padding(pair):
    _, _, ours = pair
    seqs = [torch.randint(0, vocab(ours), (n,)) for n in (5, 17, 1, 30)]
    offs, width = [0, 5, 22, 23, 53], 30
    ids_r, ids_l = torch.zeros(4, width, dtype=torch.long), torch.zeros(4, width, dtype=torch.long)
    right, left = torch.zeros_like(ids_r), torch.zeros_like(ids_l)
    for r, s in enumerate(seqs):
        ids_r[r, :len(s)], right[r, :len(s)] = s, 1
        ids_l[r, width - len(s):], left[r, width - len(s):] = s, 1
    with torch.no_grad():
        alone = [ours.token_logprobs(s[None])[0] for s in seqs]
        packed = ours.token_logprobs(torch.cat(seqs), cu_seqlens=torch.tensor(offs))
        restart_positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        restart = ours.token_logprobs(torch.cat(seqs)[None], position_ids=restart_positions)[0]
        padded_right = ours.token_logprobs(ids_r, attention_mask=right)
        padded_left = ours.token_logprobs(ids_l, attention_mask=left)
    for r, s in enumerate(seqs):
        assert torch.equal(packed[offs[r]:offs[r + 1]], alone[r])
        assert torch.equal(restart[offs[r]:offs[r + 1]], alone[r])
        assert torch.equal(padded_right[r, :len(s)], alone[r])
        assert torch.equal(padded_left[r, width - len(s):], alone[r])
        assert alone[r][0] == 0


def test_token_logprobs_values_and_temperature(pair):
    _, hf, ours = pair
    ids = torch.randint(0, vocab(ours), (2, 12))
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits.double() / 0.5, -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
        got = ours.token_logprobs(ids, temperature=0.5)
        per_seq = ours.token_logprobs(ids, temperature=torch.tensor([0.5, 2.0]))
    assert torch.allclose(got[:, 1:].double(), want, atol=1e-4)
    assert torch.equal(per_seq[0], got[0]) and not torch.equal(per_seq[1], got[1])
    with pytest.raises(ValueError, match="one per sequence"):
        ours.token_logprobs(ids, temperature=torch.tensor([1.0]))


def test_token_logprobs_is_differentiable(pair):
    _, _, ours = pair
    ids = torch.randint(0, vocab(ours), (2, 9))
    (-ours.token_logprobs(ids).sum()).backward()
    try:
        missing = [n for n, p in ours.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing
        assert ours.get_parameter(attention_output_name(ours)).grad.abs().sum() > 0
        assert ours.get_output_embeddings().weight.grad.abs().sum() > 0
    finally:
        ours.zero_grad(set_to_none=True)


def test_gradient_checkpointing_gives_same_grads(pair):
    _, _, ours = pair
    ids = torch.randint(0, vocab(ours), (2, 9))
    weight = ours.get_parameter(attention_output_name(ours))
    ours.train()
    try:
        ref = torch.autograd.grad(ours(ids, labels=ids).loss, weight)[0]
        ours.gradient_checkpointing_enable()
        got = torch.autograd.grad(ours(ids, labels=ids).loss, weight)[0]
    finally:
        ours.gradient_checkpointing_disable()
        ours.eval()
    assert torch.allclose(got, ref, atol=1e-6)


def test_activation_checkpointing_keeps_attention_outputs(pair, monkeypatch):
    """Under activation checkpointing each layer's attention forward (and a gated DeltaNet layer's
    delta-rule walk) runs once per step (their outputs are kept, the rest of the layer is
    recomputed), twice with the caller's full-recompute ``context_fn``, and every gradient is
    bitwise the one without checkpointing."""
    packed = importlib.import_module("vexact_models.kernels.attention_packed")  # the package's name is the op
    rule = importlib.import_module("vexact_models.kernels.gated_delta_rule")
    _, _, ours = pair
    calls = []
    reference, walk = packed.attention_reference, rule.training_forward
    monkeypatch.setattr(packed, "attention_reference", lambda *a, **k: calls.append(1) or reference(*a, **k))
    monkeypatch.setattr(rule, "training_forward", lambda *a, **k: calls.append(1) or walk(*a, **k))
    ids = torch.randint(0, vocab(ours), (2, 9))
    params = [p for p in ours.parameters() if p.requires_grad]

    def grads_and_calls(**kwargs):
        calls.clear()
        if kwargs:
            ours.gradient_checkpointing_enable(**kwargs)
        try:
            return torch.autograd.grad(-ours.token_logprobs(ids).sum(), params), len(calls)
        finally:
            ours.gradient_checkpointing_disable()

    ours.train()
    try:
        want, plain = grads_and_calls()
        kept, once = grads_and_calls(gradient_checkpointing_kwargs={"use_reentrant": False})
        full, twice = grads_and_calls(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": torch.utils.checkpoint.noop_context_fn})
    finally:
        ours.eval()
    layers = len(attention_layers(ours)) + sum(isinstance(m, GatedDeltaNet) for m in ours.modules())
    assert (plain, once, twice) == (layers, layers, 2 * layers)
    for got in (kept, full):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_save_pretrained_writes_stock_layout_that_both_load(pair, checkpoint, tmp_path):
    """Our save_pretrained writes the tensor names stock's does (one per expert for MoE hub
    layouts); it loads back bitwise into ours and into stock."""
    arch, _, ours = pair
    ours.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(checkpoint[1] / "model.safetensors"))
    want = ours.state_dict()
    for loaded in (arch.causal_lm_class.from_pretrained(tmp_path, dtype=torch.float32),
                   arch.hf_class().from_pretrained(tmp_path, dtype=torch.float32)):
        got = loaded.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), type(loaded)


def test_in_memory_layout_checkpoint_loads(pair, tmp_path):
    """A checkpoint written from the state dict as is (fused experts for MoE) loads too."""
    arch, _, ours = pair
    ours.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in ours.state_dict().items() if k != "lm_head.weight" or
               not ours.config.tie_word_embeddings}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = arch.causal_lm_class.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def _corrupt(checkpoint, tmp_path, edit):
    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_missing_tensor_is_an_error_naming_it(pair, checkpoint, tmp_path):
    arch, path = checkpoint
    name = attention_output_name(pair[2], -1)
    broken = _corrupt(path, tmp_path, lambda t: t.pop(saved_name(t, name)))
    with pytest.raises(ValueError, match=re.escape(f"missing tensor(s) ['{name}']")):
        arch.causal_lm_class.from_pretrained(broken)


def test_misshaped_tensor_is_an_error_naming_it(pair, checkpoint, tmp_path):
    arch, path = checkpoint
    name = attention_output_name(pair[2])

    def edit(tensors):
        saved = saved_name(tensors, name)
        tensors[saved] = torch.zeros(8, tensors[saved].shape[1])

    broken = _corrupt(path, tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(f"{name} has shape (8, ")):
        arch.causal_lm_class.from_pretrained(broken)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_tied_embeddings_share_storage(name, tmp_path):
    arch = ARCHS[name]
    stock_model(arch, tie_word_embeddings=True).save_pretrained(tmp_path)
    model = arch.causal_lm_class.from_pretrained(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bad_token_ids_and_positions(pair):
    _, _, ours = pair
    v = vocab(ours)
    with pytest.raises(ValueError, match=f"token id {v}, outside the vocabulary"):
        ours(torch.tensor([[1, v]]))
    with pytest.raises(ValueError, match="token id -1"):
        ours.token_logprobs(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="position_ids contains -1"):
        ours(torch.tensor([[1, 2]]), position_ids=torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        ours(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3))


def test_inference_variant_shares_storage(pair):
    arch, _, ours = pair
    inference = arch.inference_class(ours)
    assert {p.data_ptr() for p in inference.parameters()} == {p.data_ptr() for p in ours.parameters()}
    assert inference.kv_cache_spec()[0] == ours.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS.values(), ids=lambda a: a.name)
def test_import_path_names_where_users_import_the_class(arch):
    """`registry.import_path`, which error messages print, imports the very class."""
    from vexact_models.registry import import_path

    path = import_path(arch.causal_lm_class)
    module, _, name = path.rpartition(".")
    assert path == f"vexact_models.{arch.name}.{arch.causal_lm_class.__name__}"  # the package, not .modeling
    assert getattr(importlib.import_module(module), name) is arch.causal_lm_class
