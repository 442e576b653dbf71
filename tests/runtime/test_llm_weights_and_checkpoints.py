"""The engine front end (runtime/llm.py), continued: weight sharing and update_weights,
sleep/wake_up, failure recovery, checkpoint folders with a tokenizer, the progress bar."""

import copy

import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM, SamplingParams

from .llm_support import BS, gen, make_llm, result


PROMPTS_W = [[5, 6, 7, 8], [40, 41, 42]]
PARAMS_W = SamplingParams(temperature=0.9, max_tokens=5, seed=21, ignore_eos=True)


def run_w(llm):
    return [result(o) for o in gen(llm, PROMPTS_W, PARAMS_W)]


def test_engine_shares_parameter_storage_with_the_training_model(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    ours = dict(m.named_parameters())
    engine = dict(llm.model.causal_lm.named_parameters())
    assert ours.keys() == engine.keys()
    assert all(ours[n].data_ptr() == engine[n].data_ptr() for n in ours)
    before = run_w(llm)
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    after = run_w(llm)
    assert after != before
    assert after == run_w(make_llm(copy.deepcopy(m)))


def test_update_weights_copies_new_values(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    before = run_w(llm)
    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    want = run_w(make_llm(target))
    assert want != before
    # the trainer's natural call: its whole state_dict (a tied model lists lm_head.weight too)
    llm.update_weights(target.state_dict())
    assert run_w(llm) == want
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), target.parameters()))
    # an iterable of (name, tensor) pairs works too
    llm.update_weights(list(model.named_parameters()))
    assert run_w(llm) == before


@pytest.mark.parametrize("bad, words", [
    (("model.layers.0.mlp.gate.weight", torch.zeros(3)), ["model.layers.0.mlp.gate.weight", "unknown"]),
    (("model.norm.weight", torch.zeros(65)), ["model.norm.weight", "(65,)", "(64,)"]),
])
def test_update_weights_rejects_bad_names_and_shapes_and_writes_nothing(model, bad, words):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    snapshot = {n: p.detach().clone() for n, p in m.named_parameters()}
    name = "model.layers.1.self_attn.q_proj.weight"
    good = (name, torch.zeros_like(snapshot[name]))
    with pytest.raises(ValueError) as info:
        llm.update_weights(dict([good, bad]))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(p, snapshot[n]) for n, p in m.named_parameters())


# -- 12. sleep / wake_up ----------------------------------------------------------------------------

def test_sleep_frees_the_cache_and_wake_up_restores_it(model):
    llm = make_llm(model)
    before = run_w(llm)
    num_layers = model.config.num_hidden_layers
    assert len(llm.runner.kv_caches) == num_layers
    shapes = [(k.shape, v.shape) for k, v in llm.runner.kv_caches]
    llm.sleep()
    assert llm.runner.kv_caches == []
    llm.sleep()  # idempotent
    # generating while asleep is a clear error and leaves nothing queued
    with pytest.raises(RuntimeError, match="wake_up"):
        gen(llm, PROMPTS_W, PARAMS_W)
    assert not llm.scheduler.has_unfinished()
    llm.wake_up()
    assert [(k.shape, v.shape) for k, v in llm.runner.kv_caches] == shapes
    llm.wake_up()  # no-op when awake
    assert run_w(llm) == before
    # the re-allocated cache is uninitialised memory: whatever it holds (even NaN) must not leak
    for k, v in llm.runner.kv_caches:
        k.fill_(float("nan")), v.fill_(float("nan"))
    assert run_w(llm) == before


def test_a_failing_step_does_not_wedge_the_engine(model, monkeypatch):
    llm = make_llm(model)
    before = run_w(llm)
    calls = []
    real = llm.runner.run

    def flaky(inputs, *args, **kwargs):  # every step runs through run(), ordinary or scheduled ahead
        calls.append(len(inputs.seq_lens))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "run", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_w(llm)
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert run_w(llm) == before


# -- 13. text prompts through a checkpoint folder --------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_qwen3")
    vocab = {f"w{i}": i for i in range(512)}
    vocab["[UNK]"] = 512  # outside the model's vocabulary (512): an unknown word is a bad token id
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    torch.manual_seed(1)
    hf = transformers.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()
    hf.save_pretrained(path)
    return path, hf


def test_llm_loads_a_checkpoint_folder_with_its_tokenizer(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_num_batched_tokens=32)
    assert type(llm.model.causal_lm) is qwen3.Qwen3ForCausalLM and llm.tokenizer is not None
    assert llm.dtype == torch.float32 and llm.eos_token_ids == [1]
    ours = llm.model.causal_lm.state_dict()
    assert all(torch.equal(t, ours[n]) for n, t in hf.state_dict().items())
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    [out] = gen(llm, ["w1 w2 w3"], sp)
    assert out.prompt == "w1 w2 w3" and out.prompt_token_ids == [1, 2, 3]
    c = out.outputs[0]
    assert len(c.token_ids) == 5
    assert c.text == llm.tokenizer.decode(c.token_ids) == " ".join(f"w{t}" for t in c.token_ids)
    # the same as token-id prompts over the same weights (and text and ids mix in one call)
    twin = make_llm(qwen3.Qwen3ForCausalLM.from_pretrained(str(path)).eval())
    [want] = gen(twin, [[1, 2, 3]], sp)
    assert (c.token_ids, c.logprobs) == (want.outputs[0].token_ids, want.outputs[0].logprobs)
    mixed = gen(llm, [[1, 2, 3], "w1 w2 w3"], sp)
    assert result(mixed[0]) == result(mixed[1]) == result(out)
    assert mixed[0].prompt is None and mixed[0].outputs[0].text == c.text


def test_vllm_prompt_dicts(checkpoint):
    """vLLM's prompt dicts (TokensPrompt, TextPrompt) give what their ids and text give; a dict
    with neither, both, or anything else is refused naming its keys, before any work."""
    path, _ = checkpoint
    llm = LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = gen(llm, [[1, 2, 3], "w1 w2 w3"], sp)
    dicts = gen(llm, [{"prompt_token_ids": [1, 2, 3]}, {"prompt": "w1 w2 w3"}], sp)
    assert [result(o) for o in dicts] == [result(o) for o in plain]
    assert (dicts[0].prompt, dicts[1].prompt) == (None, "w1 w2 w3")
    assert result(gen(llm, {"prompt_token_ids": [1, 2, 3]}, sp)[0]) == result(plain[0])  # one dict, not a list
    for bad in ({"prompt": "w1", "prompt_token_ids": [1]}, {"prompt_token_ids": [1], "multi_modal_data": {}}, {}):
        with pytest.raises(ValueError, match=r"a prompt dict holds 'prompt_token_ids' .* got keys"):
            gen(llm, [[1, 2], bad], sp)
    assert not llm.scheduler.has_unfinished()


def test_a_hub_model_id_loads_from_the_hub_cache(checkpoint, tmp_path, monkeypatch):
    """``LLM("org/name")`` as vLLM takes it: the model is fetched into the hub cache (here found
    there, offline, laid out as a download leaves it) and loads with its tokenizer as the folder
    does; an id neither fetchable nor cached is a ValueError naming it."""
    import shutil

    from huggingface_hub import constants

    path, _ = checkpoint
    repo = tmp_path / "models--org--tiny-qwen3"
    shutil.copytree(path, repo / "snapshots" / ("1" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    kwargs = dict(device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    from_hub = LLM("org/tiny-qwen3", **kwargs)
    assert from_hub.tokenizer is not None
    [want] = gen(LLM(str(path), **kwargs), ["w1 w2 w3"], sp)
    [got] = gen(from_hub, ["w1 w2 w3"], sp)
    assert result(got) == result(want) and got.outputs[0].text == want.outputs[0].text
    with pytest.raises(ValueError, match=r"model='org/absent' is neither a checkpoint folder nor a hub model id"):
        LLM("org/absent", **kwargs)
    with pytest.raises(ValueError, match=r"model='/no/such/folder' is neither"):
        LLM("/no/such/folder", **kwargs)


def test_a_checkpoint_without_its_head_is_refused_for_rollouts(checkpoint, tmp_path):
    """The training class initialises a head the checkpoint lacks (as transformers does, for
    critics and new heads); the engine would sample from it, so it names the tensor instead."""
    from safetensors.torch import load_file, save_file

    from vexact_models.loading import CheckpointError

    import transformers

    path, _ = checkpoint
    torch.manual_seed(2)
    hf = transformers.Qwen3ForCausalLM(qwen3.tiny_config(tie_word_embeddings=False)).eval()
    headless = tmp_path / "headless"
    hf.save_pretrained(headless)
    tensors = load_file(headless / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, headless / "model.safetensors", metadata={"format": "pt"})
    trained = qwen3.Qwen3ForCausalLM.from_pretrained(str(headless))  # lenient: a new head
    assert trained.lm_head.weight.shape == hf.lm_head.weight.shape
    for load in (lambda: LLM(str(headless), device="cpu", block_size=BS, kv_cache_bytes=1 << 20),
                 lambda: qwen3.Qwen3ForCausalLMInference.from_pretrained(str(headless))):
        with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['lm_head\.weight'\]"):
            load()
    assert LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20).model is not None  # complete: loads


def test_checkpoint_generation_config_eos_list_is_used(checkpoint, tmp_path):
    """generation_config.json's EOS list (Qwen3: [<|im_end|>, <|endoftext|>]) stops generation."""
    import json
    import shutil

    path, _ = checkpoint
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [out] = gen(LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20), ["w7 w8 w9 w10"], sp)
    tokens = out.outputs[0].token_ids
    k = next(k for k in range(1, 8) if tokens[k] not in tokens[:k] and tokens[k] != 1)
    folder = tmp_path / "ckpt"
    shutil.copytree(path, folder)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [1, tokens[k]]
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    llm = LLM(str(folder), device="cpu", block_size=BS, kv_cache_bytes=1 << 20)
    assert llm.eos_token_ids == [1, tokens[k]]
    [out] = gen(llm, ["w7 w8 w9 w10"], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == tokens[k]  # (not the model's own EOS: a stop token, reported as vLLM's)
    [out] = gen(llm, ["w7 w8 w9 w10"], sp)
    assert out.outputs[0].token_ids == tokens
    # the tokenizer's EOS is the model's own, as vLLM takes it: first, and no stop_reason
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = f"w{tokens[k]}"
    llm = LLM(str(folder), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, tokenizer=tokenizer)
    assert llm.eos_token_ids == [tokens[k], 1]
    [out] = gen(llm, ["w7 w8 w9 w10"], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].stop_reason is None


@pytest.mark.parametrize("text, words", [
    ("", ["empty"]),
    ("w1 nonsense w2", ["token id 512", "vocabulary"]),
    (" ".join(["w5"] * 40), ["length 40", "max_model_len=32"]),
])
def test_bad_text_prompts_raise_and_leave_nothing_behind(checkpoint, text, words):
    path, _ = checkpoint
    llm = LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_model_len=32)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError) as info:
        gen(llm, ["w1 w2 w3", text], sp)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not llm.scheduler.has_unfinished()
    [out] = gen(llm, ["w1 w2 w3"], sp)
    assert len(out.outputs[0].token_ids) == 3


# -- 14. progress bar ------------------------------------------------------------------------------

def test_progress_bar(model, capsys):
    llm = make_llm(model)
    prompts = [[5, 6], [7, 8, 9], [10]]
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    capsys.readouterr()
    quiet = llm.generate(prompts, sp, use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    loud = llm.generate(prompts, sp, use_tqdm=True)
    captured = capsys.readouterr()
    assert "generate" in captured.err and "3/3" in captured.err
    assert [result(o) for o in loud] == [result(o) for o in quiet]
