"""Rollouts with PEFT LoRA adapters in the engine's graph-shaped steps: every step padded to its
CUDA-graph bucket (decode and mixed steps) as the graphs replay it, on CPU (`llm_support.CalledGraphs`: the
graphs' buffers and buckets, each "replay" an eager forward), with each fused projection group's
adapters stacked (one shrink, one expand); bitwise ``token_logprobs`` at every architecture, and
with adapters disabled, merged and unmerged between rollouts of one engine, which captures its
graphs again whenever the adapters' state changes (docs/design.md section 8, drop-in). The real
CUDA graphs: the `gpu` test at the end."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vexact_models.adapters import adapter_state, stacked_lora
from vexact_models.adapters import expert_lora_b, expert_target_parameters
from vexact_models.runtime import LLM, SamplingParams, llm_setup, model_runner

from ..models.model_support import SHAPES, adapts_experts, shape_id, skip_without_rollout, stock_model
from .llm_support import CalledGraphs, gen, make_llm, prompts_for, training_logprobs

PARAMS = SamplingParams(temperature=1.0, max_tokens=5, seed=5, ignore_eos=True)


def graph_shaped_llm(model, monkeypatch, **kwargs) -> LLM:
    """A CPU engine whose steps run as `CalledGraphs` (decode buckets up to 8 sequences, mixed
    steps up to 32 tokens), recaptured as CUDA graphs would be."""
    monkeypatch.setattr(model_runner, "StepGraphs", CalledGraphs)
    llm = make_llm(model, max_num_seqs=8, max_num_batched_tokens=32, **kwargs)
    llm.runner.cuda_graph_batch, llm.runner.cuda_graph_tokens = 8, 32
    llm.runner.free_cache()
    llm.runner.allocate_cache()
    llm._remember_graphs(llm.backend)
    assert isinstance(llm.runner.graphs, CalledGraphs)
    return llm


def lora_model(arch, shape=None, seed=1):
    """Our model at `shape` under random LoRA adapters (r=4) on every linear layer and on both
    fused expert tensors of a MoE model (PEFT's target_parameters)."""
    hf = stock_model(arch, shape=shape)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    torch.manual_seed(seed)
    return get_peft_model(ours, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                           init_lora_weights=False, target_parameters=expert_target_parameters(ours)))


def check_against_training(model, llm, prompts) -> list:
    outs = gen(llm, prompts, PARAMS)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert torch.equal(training_logprobs(model, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))
    return [o.outputs[0].logprobs for o in outs]


def groups_of(model):
    return [g for m in model.modules() if callable(getattr(m, "projection_groups", None))
            for g in m.projection_groups()]


@pytest.mark.parametrize("pair", SHAPES, ids=shape_id)
def test_graph_shaped_rollouts_with_stacked_adapters_equal_token_logprobs(pair, monkeypatch):
    arch, shape = pair
    skip_without_rollout(arch, "cuda_graphs")
    model = lora_model(arch, shape)
    llm = graph_shaped_llm(model, monkeypatch)
    adapted = [g for g in groups_of(model) if all(hasattr(lin, "lora_A") for lin in g)]
    assert adapted and all(stacked_lora(g) is not None for g in adapted)  # fused by the engine: one shrink per group
    prompts = prompts_for(5, seed=3) + prompts_for(1, seed=4, lo=40, hi=50)  # a prompt past one mixed step
    check_against_training(model, llm, prompts)
    graphs = llm.runner.graphs
    assert graphs.mixed_replays > 0 and graphs is llm.runner.graphs  # mixed steps ran as graphs, not recaptured


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_adapters_disabled_merged_and_unmerged_between_rollouts(name, monkeypatch):
    arch = next(a for a, _ in SHAPES if a.name == name)
    model = lora_model(arch)
    assert adapts_experts(model) == (name == "qwen3_moe")  # merged and unmerged through PEFT's ParamWrapper too
    llm = graph_shaped_llm(model, monkeypatch)
    prompts = prompts_for(4, seed=7)
    seen = [llm.runner.graphs]

    def rollout():
        logprobs = check_against_training(model, llm, prompts)
        seen.append(llm.runner.graphs)
        return logprobs

    with_adapters = rollout()
    assert rollout() == with_adapters and seen[-1] is seen[-2]  # nothing changed: no recapture
    with model.disable_adapter():
        state = adapter_state(llm.model)
        plain = rollout()
        assert seen[-1] is not seen[-2]  # the adapters' state changed: captured again
        assert plain != with_adapters
    assert rollout() == with_adapters and seen[-1] is not seen[-2]
    model.merge_adapter()
    assert adapter_state(llm.model) != state
    rollout()
    assert seen[-1] is not seen[-2]
    model.unmerge_adapter()
    rollout()
    assert seen[-1] is not seen[-2]


def test_adapter_state_follows_peft():
    arch = next(a for a, _ in SHAPES if a.name == "qwen3")
    model = lora_model(arch)
    state = adapter_state(model)
    assert len(state) == sum(1 for m in model.modules() if hasattr(m, "lora_A")) > 0
    assert adapter_state(model) == state
    with model.disable_adapter():
        assert adapter_state(model) != state
    assert adapter_state(model) == state
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.lora_A["default"].weight.data = layer.lora_A["default"].weight.data.clone()  # replaced storage
    assert adapter_state(model) != state
    assert adapter_state(model.get_base_model().model.embed_tokens) == ()


def by_expert(b, experts):
    """B ``[N, r * E]`` in PEFT's layout as ``[E, N, r]`` (`ExpertLora.b_by_expert`'s values)."""
    return b.detach().unflatten(1, (b.shape[1] // experts, experts)).permute(2, 0, 1)


def test_engine_keeps_expert_b_by_expert_refreshed_at_every_call(monkeypatch):
    """Where the Triton experts run, the runner keeps every adapted expert tensor's B copied by
    expert (`ModelRunner.kept_b`, which the expands read: `kernels.KeptExpertB`): made with its
    cache, copied again in place at every `generate` (B changed in place between calls, as an
    optimizer step changes it), dropped at `sleep`, made again at `wake_up`; with
    ``VEXACT_EXPERT_B=call`` none, the graphs captured again. `expert_lora_b` lists what a forward
    adds: nothing while the adapters are disabled or merged. The runner is told the Triton backend
    runs (its kernels stay the CPU reference's, which read B itself); the CUDA test below runs the
    kernels that read the copies."""
    monkeypatch.setattr(model_runner, "current_backend", lambda device: "triton")
    arch = next(a for a, _ in SHAPES if a.name == "qwen3_moe")
    model = lora_model(arch)
    sources = expert_lora_b(model)
    moe_layers = sum(1 for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    assert moe_layers and len(sources) == 2 * moe_layers  # gate_up_proj and down_proj, not the routers PEFT adapts
    assert all(experts == model.config.num_experts and b.shape[1] % experts == 0 for b, experts in sources)
    llm = graph_shaped_llm(model, monkeypatch)
    kept = llm.runner.kept_b
    copies = [kept.copy_of(b, experts) for b, experts in sources]
    assert len(kept) == len(sources) and all(torch.equal(c, by_expert(b, e)) for c, (b, e) in zip(copies, sources))
    with torch.no_grad():
        for b, _ in sources:
            b.add_(0.25)
    check_against_training(model, llm, prompts_for(3, seed=2))
    assert llm.runner.kept_b is kept and len(kept) == len(sources)
    assert all(kept.copy_of(b, e) is c and torch.equal(c, by_expert(b, e)) for c, (b, e) in zip(copies, sources))
    llm.sleep()
    assert llm.runner.kept_b is None
    llm.wake_up()
    assert llm.runner.kept_b is not kept and len(llm.runner.kept_b) == len(sources)
    graphs = llm.runner.graphs
    monkeypatch.setenv("VEXACT_EXPERT_B", "call")
    check_against_training(model, llm, prompts_for(2, seed=5))
    assert llm.runner.kept_b is None and llm.runner.graphs is not graphs
    with model.disable_adapter():
        assert expert_lora_b(model) == []
    model.merge_adapter()
    assert expert_lora_b(model) == []
    model.unmerge_adapter()
    assert len(expert_lora_b(model)) == len(sources)


def test_engine_without_graphs_keeps_copies_of_the_adapted_b_alone_and_within_its_budget(monkeypatch):
    """Without CUDA graphs (``enforce_eager``) no copy is read past its call: a B replaced (a new
    storage, as ``load_state_dict(assign=True)`` makes) loses its copy at the next call, so the
    table holds the adapted B alone however often they change. And the copies stay within the
    bytes the engine's budget set aside (`llm_setup.kept_b_budget`, through `EngineConfig`): a
    budget measured before adapters came (verl's rollout adds them at its first weight sync)
    keeps none of theirs; forwards copy B per call instead. As above, the runner is told the
    Triton backend runs."""
    import dataclasses

    monkeypatch.setattr(model_runner, "current_backend", lambda device: "triton")
    arch = next(a for a, _ in SHAPES if a.name == "qwen3_moe")
    model = lora_model(arch)
    llm = make_llm(model, max_num_seqs=8, max_num_batched_tokens=32)
    kept, count = llm.runner.kept_b, len(expert_lora_b(model))
    assert llm.runner.graphs is None and llm.runner.kept_b_limit is None and len(kept) == count
    for seed in (2, 3):
        with torch.no_grad():
            for b, _ in expert_lora_b(model):
                b.data = b.data.clone() + 0.125  # a new storage, new values
        check_against_training(model, llm, prompts_for(2, seed=seed))
        assert llm.runner.kept_b is kept and len(kept) == count
        assert all(torch.equal(kept.copy_of(b, e), by_expert(b, e)) for b, e in expert_lora_b(model))
    sizes = [b.numel() * b.element_size() for b, _ in expert_lora_b(model)]
    cuda = torch.device("cuda")  # kept_b_budget asks nothing of the device itself
    assert llm_setup.kept_b_budget(llm.model, cuda, None) == sum(sizes)
    assert llm_setup.kept_b_budget(llm.model, cuda, 1 << 20) is None
    assert llm_setup.kept_b_budget(llm.model, torch.device("cpu"), None) is None
    with model.disable_adapter():  # as before adapters come
        assert llm_setup.kept_b_budget(llm.model, cuda, None) == 0
    for limit, held in ((0, 0), (sizes[0], 1), (sum(sizes) - 1, count - 1), (sum(sizes), count)):
        config = dataclasses.replace(llm.engine_config, kept_b_limit=limit)
        runner = config.make_runner(llm.model, llm.device, llm.dtype)
        assert runner.kept_b_limit == limit and len(runner.kept_b) == held and runner.kept_b.nbytes == sum(sizes[:held])
        runner.free_cache()
    monkeypatch.setenv("VEXACT_EXPERT_B", "call")
    assert llm_setup.kept_b_budget(llm.model, cuda, None) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("shrink", ["side", "inline"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_cuda_graph_rollouts_with_adapters_toggled_equal_token_logprobs(name, shrink, monkeypatch):
    """The engine's real CUDA graphs (decode and mixed steps) with bf16 weights and fp32 adapters
    (Qwen3-MoE's fused experts adapted too: `kernels/moe_lora.py` captured), the groups' shrinks
    beside their base GEMMs or in line (``VEXACT_LORA_SHRINK``, `side_stream.shrink_beside`):
    bitwise ``token_logprobs`` with adapters on, disabled, merged and unmerged between rollouts."""
    monkeypatch.setenv("VEXACT_LORA_SHRINK", shrink)
    arch = next(a for a, _ in SHAPES if a.name == name)
    torch.manual_seed(0)
    dims = dict(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    ours = arch.causal_lm_class(arch.shapes[0].tiny_config(**dims)).to("cuda", torch.bfloat16).eval()
    model = get_peft_model(ours, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False,  # adapters in fp32, PEFT's default
                                            target_parameters=expert_target_parameters(ours)))  # the MoE experts too
    llm = LLM(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    assert llm.runner.graphs is not None
    prompts = prompts_for(6, seed=11, lo=3, hi=30) + prompts_for(1, seed=12, lo=60, hi=70)

    def rollout():
        outs = gen(llm, prompts, PARAMS)
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            lp = training_logprobs(model, prompt, c.token_ids, 1.0).cpu()
            assert torch.equal(lp, torch.tensor(c.logprobs))
        assert llm.runner.graphs.mixed_replays > 0
        return [o.outputs[0].logprobs for o in outs]

    first = rollout()
    with model.disable_adapter():
        assert rollout() != first
    assert rollout() == first
    model.merge_adapter()
    rollout()
    model.unmerge_adapter()
    rollout()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_cuda_graph_rollouts_read_the_kept_expert_b_refreshed_after_an_optimizer_step(monkeypatch):
    """Qwen3-MoE with both fused expert tensors adapted, on the engine's CUDA graphs: the experts'
    expands read B's kept copies (`ModelRunner.kept_b`): no copy of B is made by a step, eager,
    captured or replayed. After an optimizer step changes every adapter in place, the next rollout
    replays the same graphs over the same copies, refreshed, and equals ``token_logprobs`` with
    the new adapters, bitwise."""
    from vexact_models.kernels import expert_lora

    arch = next(a for a, _ in SHAPES if a.name == "qwen3_moe")
    torch.manual_seed(0)
    dims = dict(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    ours = arch.causal_lm_class(arch.shapes[0].tiny_config(**dims)).to("cuda", torch.bfloat16).eval()
    model = get_peft_model(ours, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False, target_parameters=expert_target_parameters(ours)))
    llm = LLM(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    graphs, kept = llm.runner.graphs, llm.runner.kept_b
    assert graphs is not None and kept is not None and len(kept) == len(expert_lora_b(model)) > 0
    new_copies = []
    copy = expert_lora.b_by_expert_triton
    monkeypatch.setattr(expert_lora, "b_by_expert_triton",
                        lambda b, experts, out=None: (new_copies.append(out is None), copy(b, experts, out))[1])
    prompts = prompts_for(6, seed=11, lo=3, hi=30) + prompts_for(1, seed=12, lo=60, hi=70)

    def rollout():
        new_copies.clear()
        outs = gen(llm, prompts, PARAMS)
        assert new_copies == [False] * len(kept)  # the refresh at the call's start, in place; no step copies B
        for prompt, out in zip(prompts, outs):
            assert torch.equal(training_logprobs(model, prompt, out.outputs[0].token_ids, 1.0).cpu(),
                               torch.tensor(out.outputs[0].logprobs))
        return [o.outputs[0].logprobs for o in outs]

    first = rollout()
    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    for p in adapters:
        p.grad = torch.randn_like(p)
    optimizer.step()
    second = rollout()
    assert second != first and llm.runner.graphs is graphs and llm.runner.kept_b is kept
    assert graphs.mixed_replays > 0
    # the KV budget measured on the device holds the copies (`llm_setup.kv_cache_pages`)
    per_page = llm_setup.cache_bytes_per_block(llm.model, torch.bfloat16, 16)
    pages = {}
    for mode in ("kept", "call"):
        monkeypatch.setenv("VEXACT_EXPERT_B", mode)
        pages[mode] = llm_setup.kv_cache_pages(llm.model, torch.bfloat16, llm.device, None, 16, 0.9, None)[0]
    assert pages["call"] - pages["kept"] in (kept.nbytes // per_page, kept.nbytes // per_page + 1)
