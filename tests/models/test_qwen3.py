"""Qwen3 training variant: HF parity, packing/padding invariance, checkpoints, errors."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from vexact_models.qwen3 import Qwen3ForCausalLM, Qwen3ForCausalLMInference, Qwen3Model, tiny_config

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stock transformers Qwen3 checkpoint (safetensors) with random weights."""
    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    HFQwen3ForCausalLM(tiny_config(tie_word_embeddings=False)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint):
    hf = HFQwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return hf, ours


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_logits_match_stock_transformers_fp32(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (3, 37))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= 1e-5


def test_right_padded_logits_match_stock_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    assert rel(a[mask.bool()], b[mask.bool()]) <= 1e-5
    assert torch.all(a[~mask.bool()] == 0)


def test_loss_and_gradients_match_stock_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 16))
    labels = ids.clone()
    labels[0, :4] = -100
    loss_hf = hf(ids, labels=labels).loss
    loss_ours = ours(ids, labels=labels).loss
    assert abs(float(loss_hf) - float(loss_ours)) < 1e-5
    g_hf = dict(zip([n for n, _ in hf.named_parameters()], torch.autograd.grad(loss_hf, list(hf.parameters()))))
    g_ours = dict(zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(loss_ours, list(ours.parameters()))))
    assert g_hf.keys() == g_ours.keys()
    for name in g_hf:
        assert rel(g_ours[name], g_hf[name]) < 1e-4, name


def test_token_logprobs_bitwise_across_packing_and_padding(pair):
    _, ours = pair
    seqs = [torch.randint(0, 512, (n,)) for n in (5, 17, 1, 30)]
    with torch.no_grad():
        alone = [ours.token_logprobs(s[None])[0] for s in seqs]
        packed = ours.token_logprobs(torch.cat(seqs), cu_seqlens=torch.tensor([0, 5, 22, 23, 53]))
        restart_positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        restart = ours.token_logprobs(torch.cat(seqs)[None], position_ids=restart_positions)[0]
        width = 30
        ids = torch.zeros(4, width, dtype=torch.long)
        right, left = torch.zeros(4, width, dtype=torch.long), torch.zeros(4, width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = s
            right[r, :len(s)] = 1
        padded = ours.token_logprobs(ids, attention_mask=right)
        ids_l = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids_l[r, width - len(s):] = s
            left[r, width - len(s):] = 1
        padded_left = ours.token_logprobs(ids_l, attention_mask=left)
    offs = [0, 5, 22, 23, 53]
    for r, s in enumerate(seqs):
        assert torch.equal(packed[offs[r]:offs[r + 1]], alone[r])
        assert torch.equal(restart[offs[r]:offs[r + 1]], alone[r])
        assert torch.equal(padded[r, :len(s)], alone[r])
        assert torch.equal(padded_left[r, width - len(s):], alone[r])
        assert alone[r][0] == 0


def test_token_logprobs_values_and_temperature(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits.double() / 0.5, -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
        got = ours.token_logprobs(ids, temperature=0.5)
        per_seq = ours.token_logprobs(ids, temperature=torch.tensor([0.5, 2.0]))
    assert torch.allclose(got[:, 1:].double(), want, atol=1e-4)
    assert torch.equal(per_seq[0], got[0]) and not torch.equal(per_seq[1], got[1])
    with pytest.raises(ValueError, match="one per sequence"):
        ours.token_logprobs(ids, temperature=torch.tensor([1.0]))


def test_token_logprobs_is_differentiable(pair):
    _, ours = pair
    ids = torch.randint(0, 512, (2, 9))
    loss = -ours.token_logprobs(ids).sum()
    loss.backward()
    assert ours.lm_head.weight.grad is not None and ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    ours.zero_grad(set_to_none=True)


def test_gradient_checkpointing_gives_same_grads(pair):
    _, ours = pair
    ids = torch.randint(0, 512, (2, 9))
    ours.train()
    ref = torch.autograd.grad(ours(ids, labels=ids).loss, ours.lm_head.weight)[0]
    ours.gradient_checkpointing_enable()
    try:
        got = torch.autograd.grad(ours(ids, labels=ids).loss, ours.lm_head.weight)[0]
    finally:
        ours.gradient_checkpointing_disable()
        ours.eval()
    assert torch.allclose(got, ref, atol=1e-6)


def test_save_pretrained_round_trip_safetensors(pair, tmp_path):
    _, ours = pair
    ours.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    again = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    sd, sd2 = ours.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    stored = load_file(tmp_path / "model.safetensors")
    hf_names = set(HFQwen3ForCausalLM(ours.config).state_dict())
    assert set(stored) == hf_names


def test_tied_embeddings(tmp_path):
    torch.manual_seed(0)
    HFQwen3ForCausalLM(tiny_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _corrupt(checkpoint, tmp_path, edit):
    import shutil

    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_an_error_naming_it(checkpoint, tmp_path):
    _corrupt(checkpoint, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


def test_misshaped_tensor_is_an_error_naming_it(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _corrupt(checkpoint, tmp_path, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


def test_bad_token_ids_and_positions(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="token id 512, outside the vocabulary"):
        ours(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="token id -1"):
        ours.token_logprobs(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="position_ids contains -1"):
        ours(torch.tensor([[1, 2]]), position_ids=torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        ours(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3))


def test_base_model_hidden_states_match_stock(checkpoint):
    from transformers import Qwen3Model as HFQwen3Model

    hf = HFQwen3Model.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = Qwen3Model.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        assert rel(ours(ids).last_hidden_state, hf(ids).last_hidden_state) < 1e-5


def test_inference_variant_shares_storage(pair):
    _, ours = pair
    inference = Qwen3ForCausalLMInference(ours)
    assert {p.data_ptr() for p in inference.parameters()} == {p.data_ptr() for p in ours.parameters()}
    assert inference.kv_cache_spec() == (2, 2, 16, 16)
