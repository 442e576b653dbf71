"""The window page group of models mixing windowed and full attention layers (docs/design.md
section 6, `runtime.page_groups`): the bookkeeping of `PageGroups` (the window group's pages
released behind the window while the global group keeps every page, prefix hits that take only
the window pages still read, both groups' free lists), the budget split and the KV bytes of a
sequence; the engine over tiny Gemma 3 and GPT-OSS checkpoints (stock transformers'
``save_pretrained``, windows of 8 keys under prompts of 30-70) in tests/runtime/test_page_groups_engine.py."""

import pytest
import torch

import vexact_models.llama as llama
from vexact_models.kernels.attention_window import window_block_start
from vexact_models.layers import window_layers
from vexact_models.registry import architectures, get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.prefix_cache import chain_key
from vexact_models.runtime.llm_args import default_block_size
from vexact_models.runtime.llm_setup import engine_config, kv_bytes_per_sequence, kv_cache_pages
from vexact_models.runtime.page_groups import PageGroups, window_pages_bound, window_pages_cap
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence

from .llm_support import cache_bytes, make_llm


def _seq(tokens: list[int], request: int = 0) -> Sequence:
    return Sequence(request, 0, tokens, SamplingParams(), 0)


def _computed(bm: PageGroups, seq: Sequence, num_tokens: int) -> None:
    """Allocate `seq` up to `num_tokens`, mark them computed, publish and release as the scheduler does."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq, num_tokens)
    bm.release_behind_window(seq)


def test_block_manager_lookup_can_append_and_shortfall():
    """The pieces `PageGroups` builds on, on one group: a published page found by key and content
    (not by key alone), free pages for new ones, and why a sequence can never fit."""
    bm = BlockManager(8, 4)
    seq = _seq(list(range(2, 12)))
    bm.allocate(seq, 10)
    bm.cache_full_blocks(seq, 10)
    parent, tokens = b"", tuple(range(2, 6))
    key = chain_key(parent, tokens)
    assert bm.prefix.lookup(key, (parent, tokens)) == seq.block_table[0]
    assert bm.prefix.lookup(key, (parent, (9,) * 4)) is None
    assert bm.can_append(5) and not bm.can_append(6)
    assert bm.shortfall(32, 8) is None
    assert bm.shortfall(33, 8) == "needs 9 KV cache blocks for 33 positions but the cache has only 8 blocks in total " \
        "(block_size=4)"


def test_the_window_group_releases_behind_the_window_and_the_global_group_keeps_every_page():
    bm = PageGroups(40, 4, 30, window=8)
    seq = _seq(list(range(2, 102)))
    bm.allocate(seq, 100)
    assert len(seq.block_table) == len(seq.window_pages.block_table) == 25
    assert bm.num_free_blocks == 15 and bm.window_group.num_free_blocks == 5
    assert bm.tables.table(seq.seq_id) == seq.block_table
    assert bm.window_group.tables.table(seq.seq_id) == seq.window_pages.block_table
    seq.num_computed_tokens = 100
    assert bm.release_behind_window(seq) == window_block_start(100, 8) // 4 == 16
    assert bm.num_free_blocks == 15 and bm.window_group.num_free_blocks == 21 and seq.released_blocks == 0
    assert bm.can_append(15) and not bm.can_append(16)  # each new page takes one of each group
    bm.free(seq)
    assert bm.num_free_blocks == 40 and bm.window_group.num_free_blocks == 30
    assert seq.window_pages.block_table == [] and seq.window_pages.released_blocks == 0
    assert not bm.window_group.tables.table(seq.seq_id)
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        PageGroups(4, 4, 4, window=0)


def test_a_prefix_hit_takes_the_window_pages_its_next_query_reads_and_releases_the_rest_on_arrival():
    """b shares a's prompt: 21 global pages (never the last), and of the window group only pages
    16-20 (window_block_start(84, 8) = 64), entries 0-15 released on arrival without a page; once
    a window page in that range is reused, the hit shortens to the longest run whose window pages
    are all there."""
    prompt = list(range(2, 90))
    bm = PageGroups(64, 4, 40, window=8)
    a = _seq(prompt)
    _computed(bm, a, 88)
    assert a.window_pages.released_blocks == 16 and bm.window_group.num_free_blocks == 40 - 6
    b = _seq(prompt, 1)
    assert bm.num_cached_tokens(b) == 84
    bm.allocate(b, 88)
    assert b.num_computed_tokens == 84 and b.block_table[:21] == a.block_table[:21]
    view, mine = b.window_pages, a.window_pages
    assert view.released_blocks == 16 and view.block_table[16:21] == mine.block_table[16:21]
    assert view.block_table[21] not in mine.block_table and view.released_key == bm.prefix.key(a.block_table[15])
    assert all(bm.window_group.ref_count(block) == 2 for block in mine.block_table[16:21])
    assert bm.window_group.num_free_blocks == 40 - 7  # only b's own last page is new
    a_window = list(mine.block_table)
    bm.free(b)
    bm.free(a)  # window free list: 17 unused pages, the 16 released, b's last, a's 21, 20, ..., 16
    hog = _seq(list(range(300, 452)), 2)
    _computed(bm, hog, 152)  # 38 window pages: all but those of a's entries 16 and 17 (then 32 released)
    c = _seq(prompt, 3)
    bm.allocate(c, 88)
    assert c.num_computed_tokens == 72 and c.window_pages.released_blocks == 16  # 18 pages: 16 and 17 remain
    assert c.window_pages.block_table[16:18] == a_window[16:18]
    bm.free(c)
    bm.free(hog)
    assert bm.num_free_blocks == 64 and bm.window_group.num_free_blocks == 40


def test_a_running_sequence_that_jumps_by_hits_releases_its_pages_behind_the_new_window():
    prompt = list(range(2, 90))
    bm = PageGroups(64, 4, 40, window=8)
    a = _seq(prompt)
    _computed(bm, a, 88)
    b = _seq(prompt, 1)
    bm.enable_prefix_sharing = bm.window_group.enable_prefix_sharing = False
    bm.allocate(b, 8)  # b computes its first two pages itself
    b.num_computed_tokens = 8
    bm.enable_prefix_sharing = bm.window_group.enable_prefix_sharing = True
    bm.cache_full_blocks(b, 8)
    held = list(b.window_pages.block_table)
    bm.allocate(b, 88)  # the rest by hits: 19 pages, to position 84
    assert b.num_computed_tokens == 84 and b.block_table[2:21] == a.block_table[2:21]
    assert b.window_pages.released_blocks == 16 and b.window_pages.block_table[16:21] == a.window_pages.block_table[16:21]
    assert all(bm.window_group.ref_count(block) == 0 for block in held)  # its own two went back


def test_share_prefix_takes_both_groups_and_refuses_released_window_pages():
    prompt = list(range(2, 102))
    bm = PageGroups(64, 4, 64, window=8, enable_prefix_sharing=False)
    donor = _seq(prompt)
    bm.allocate(donor, 97)
    donor.num_computed_tokens = 96
    sibling = _seq(prompt, 1)
    assert bm.can_share_prefix(96, 100)
    bm.share_prefix(sibling, donor, 96)
    assert sibling.block_table == donor.block_table[:24] and sibling.window_pages.released_blocks == 16
    assert sibling.window_pages.block_table[16:] == donor.window_pages.block_table[16:24]
    assert all(bm.window_group.ref_count(block) == 2 for block in donor.window_pages.block_table[16:24])
    assert bm.window_group.tables.table(sibling.seq_id)[16:] == donor.window_pages.block_table[16:24]
    bm.allocate(sibling, 100)
    assert bm.release_behind_window(donor) == 16
    late = _seq(prompt, 2)
    with pytest.raises(ValueError, match="released the windowed layers' pages 0..15"):
        bm.share_prefix(late, donor, 32)
    assert late.block_table == [] and late.window_pages is None and late.num_computed_tokens == 0


def test_a_sequence_whose_window_pages_cannot_fit_is_refused_and_a_tight_window_group_preempts():
    """`shortfall` names the window group; the scheduler over a window group too small for every
    running sequence preempts (and re-admits) until all finish, freeing every page."""
    bm = PageGroups(64, 4, 24, window=8)
    assert window_pages_bound(8, 4, 64) == 37 and window_pages_bound(8, 4, 8) == 23
    assert "needs 37 KV cache blocks of its windowed layers for 200 positions" in bm.shortfall(200, 64)
    assert bm.shortfall(200, 8) is None and bm.shortfall(40, 64) is None  # 10 pages in all
    bm = PageGroups(200, 4, window_pages_bound(8, 4, 8) + 2, window=8)
    sched = Scheduler(bm, 4, 8, 200, None)
    seqs = [Sequence(r, 0, list(range(10 + r, 50 + r)), SamplingParams(max_tokens=30, ignore_eos=True), r)
            for r in range(4)]
    for seq in seqs:
        sched.add(seq)
    preempted = steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        group = bm.window_group
        held = {b for s in sched._running for b in s.window_pages.block_table[s.window_pages.released_blocks:]}
        assert group.num_blocks - group.num_free_blocks == len(held)
        for s in sched._running:
            assert len(s.window_pages.block_table) - s.window_pages.released_blocks <= window_pages_bound(8, 4, 8)
        sched.postprocess(out.scheduled, [7] * len(out.scheduled), [0.0] * len(out.scheduled))
        steps += 1
        assert steps < 2000
    assert preempted > 0 and all(s.finish_reason == "length" for s in seqs)
    assert bm.num_free_blocks == 200 and bm.window_group.num_free_blocks == bm.window_group.num_blocks


ARCHS = [a.name for a in architectures() if a.name in ("gemma3", "gpt_oss")]  # (min_transformers)


@pytest.mark.parametrize("name", ARCHS)
def test_kv_bytes_per_sequence_by_hand_and_the_budget_split(name):
    """Tiny configs (3 layers: 2 windowed of 8 keys, 1 full; 2 KV heads of 16 dims): a page of a
    layer is 4 positions x 2 heads x 16 x (K and V) x 4 bytes = 1,024 bytes. At 100 tokens: 25
    pages a layer; the window keeps pages 16-24 (window_block_start(100, 8) = 64)."""
    arch = get(name)
    model = arch.causal_lm_class(arch.tiny_config()).eval()
    window, layers = window_layers(model)
    assert window == 8 and len(layers) == 2
    assert kv_bytes_per_sequence(model, 100, dtype=torch.float32, block_size=4, window_freed=False) == 3 * 25 * 1024
    assert kv_bytes_per_sequence(model, 100, dtype=torch.float32, block_size=4) == (25 + 2 * 9) * 1024
    assert kv_bytes_per_sequence(model, 5, dtype=torch.float32, block_size=4) == 3 * 2 * 1024  # nothing behind yet
    assert kv_bytes_per_sequence(model, 0, dtype=torch.float32, block_size=4) == 0
    assert kv_bytes_per_sequence(model, 100, dtype=torch.bfloat16, block_size=16) == (7 + 2 * 3) * 2048
    with pytest.raises(ValueError, match="num_tokens=-1"):
        kv_bytes_per_sequence(model, -1, dtype=torch.float32, block_size=4)
    # 256 pages' worth of bytes: 3,072 bytes a page of both groups; the window group capped at 88
    cap = window_pages_cap(8, 4, 4, 16)
    assert cap == 4 * (-(-(8 + 63 + 1) // 4) + 3) + 4 == 88
    got = kv_cache_pages(model, torch.float32, torch.device("cpu"), None, 4, 0.9, 256 * 3072, 4, (layers, cap))
    assert got == ((256 * 3072 - 88 * 2048) // 1024, 88)
    assert kv_cache_pages(model, torch.float32, torch.device("cpu"), None, 4, 0.9, 50 * 3072, 4, (layers, cap)) == (50, 50)
    llm = make_llm(model, kv_cache_bytes=256 * 3072, max_num_seqs=4, max_num_batched_tokens=16)
    assert (llm.block_manager.num_blocks, llm.block_manager.window_group.num_blocks) == got
    assert llm.engine_config.window_group.layers == layers
    assert llm.kv_bytes_per_sequence(100) == (25 + 2 * 9) * 1024
    assert llm.kv_bytes_per_sequence(100, window_freed=False) == 75 * 1024
    k, _ = llm.runner.kv_caches[layers[0]]
    assert k.shape[0] == 88 and llm.runner.kv_caches[({0, 1, 2} - set(layers)).pop()][0].shape[0] == got[0]


@pytest.mark.parametrize("name", ARCHS)
def test_engine_config_sizes_both_page_groups_and_sets_the_scheduling(name):
    """`engine_config` (what `LLM` builds its engine from): the pages of `kv_cache_pages` with the
    window group capped by `window_pages_cap`; page sharing only without gated-DeltaNet states
    (with them, the prompt's state is shared instead); CUDA graphs off under `enforce_eager`; the
    model's default page size when `block_size` is None."""
    arch = get(name)
    model = arch.causal_lm_class(arch.tiny_config()).eval()
    window, layers = window_layers(model)
    cpu = torch.device("cpu")
    args = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, eos_token_id=2,
                gpu_memory_utilization=0.9, kv_cache_bytes=256 * 3072, enable_chunked_prefill=True,
                enable_prefix_sharing=True)
    config = engine_config(model, torch.float32, cpu, None, block_size=4, linear_states=False, enforce_eager=False,
                           cuda_graph_max_tokens=None, **args)
    pages = kv_cache_pages(model, torch.float32, cpu, None, 4, 0.9, 256 * 3072, 4, (layers, window_pages_cap(window, 4, 4, 16)))
    assert (config.num_blocks, config.window_group.num_blocks) == pages
    assert (config.window_group.window, config.window_group.layers) == (window, layers)
    assert (config.block_size, config.eos_token_id, config.max_model_len) == (4, 2, 64)
    assert (config.enable_prefix_sharing, config.share_prompt_state) == (True, False)
    assert (config.cuda_graph_batch, config.cuda_graph_tokens) == (4, 16)
    config = engine_config(model, torch.float32, cpu, None, block_size=None, linear_states=True, enforce_eager=True,
                           cuda_graph_max_tokens=8, **args)
    assert config.block_size == default_block_size(model.kv_cache_spec())
    assert (config.enable_prefix_sharing, config.share_prompt_state) == (False, True)
    assert (config.cuda_graph_batch, config.cuda_graph_tokens) == (0, 8)


def test_window_layers_reads_the_modules():
    """Mixed windows: the largest and the windowed layers' indices; every layer or none windowed:
    None (one group); a mixed model whose attention does not declare its index: a ValueError."""
    model = llama.LlamaForCausalLM(llama.tiny_config(num_hidden_layers=3, sliding_window=6))
    assert window_layers(model) is None
    model.model.layers[1].self_attn.sliding_window = None
    model.model.layers[2].self_attn.sliding_window = 9
    assert window_layers(model) == (9, (0, 2))
    del model.model.layers[0].self_attn.layer_idx
    with pytest.raises(ValueError, match="layer_idx"):
        window_layers(model)
    assert window_layers(llama.LlamaForCausalLM(llama.tiny_config())) is None


def test_kv_bytes_per_sequence_of_one_group_models():
    """Every layer windowed (Mistral-like, one group): all of them freed; no window: all kept."""
    config = llama.tiny_config()
    spec = llama.LlamaForCausalLM(config).kv_cache_spec()
    per_layer = 4 * spec[1] * (spec[2] + spec[3]) * 4
    full = llama.LlamaForCausalLM(config)
    assert kv_bytes_per_sequence(full, 100, dtype=torch.float32, block_size=4) == spec[0] * 25 * per_layer
    config.sliding_window = 8
    windowed = llama.LlamaForCausalLM(config)
    assert window_layers(windowed) is None
    assert kv_bytes_per_sequence(windowed, 100, dtype=torch.float32, block_size=4) == spec[0] * 9 * per_layer
    assert make_llm(windowed).kv_bytes_per_sequence(100) == spec[0] * 9 * per_layer
    assert cache_bytes(windowed, 1) == spec[0] * per_layer


@pytest.mark.parametrize("name, config_name, window, full, windowed", [("gpt_oss", "gpt-oss-20b", 128, 12, 12),
                                                                        ("gemma3", "gemma3-text-default", 4096, 4, 22)])
def test_kv_bytes_per_sequence_at_32k_of_the_published_configs(name, config_name, window, full, windowed):
    """What the benchmark prints (benchmarks/throughput.py): the published configs built on the
    meta device, bf16 pages of 16: full layers hold 2,048 pages at 32k, windowed ones those from
    window_block_start on."""
    from vexact_models.conformance.models import make_config, published_shape

    if name not in ARCHS:
        pytest.skip(f"{name} is not registered on this transformers")
    arch, _ = published_shape(config_name)
    with torch.device("meta"):
        model = arch.causal_lm_class(make_config(arch, config_name))
    spec = model.kv_cache_spec()
    page = 16 * spec[1] * (spec[2] + spec[3]) * 2
    kept = 2048 - window_block_start(32768, window) // 16
    assert kv_bytes_per_sequence(model, 32768, dtype=torch.bfloat16, block_size=16, window_freed=False) == \
        (full + windowed) * 2048 * page
    assert kv_bytes_per_sequence(model, 32768, dtype=torch.bfloat16, block_size=16) == \
        (full * 2048 + windowed * kept) * page


@pytest.mark.parametrize("seed", range(3))
def test_every_key_a_step_reads_holds_its_own_prefix_in_both_groups(seed):
    """A simulated cache over a random workload (prompts sharing prefixes, n up to 3, prefix
    sharing, tight pools that preempt): each step writes its tokens' content (their prefix) into
    the slots the tables give, then every scheduled query checks the keys it reads, all of them
    through the global table and those from its `window_block_start` on through the window table:
    each holds exactly its own prefix, so shared and revived pages are the ones computing would
    have written. Every page comes back at the end."""
    import random

    rng = random.Random(seed)
    bs, window = 4, 8
    bm = PageGroups(56, bs, 36, window=window)
    sched = Scheduler(bm, 6, 16, 200, None)
    stems = [[rng.randrange(2, 9) for _ in range(rng.randint(60, 120))] for _ in range(3)]
    seqs = []
    for r in range(10):
        prompt = rng.choice(stems)[:rng.randint(40, 120)] + [rng.randrange(2, 9) for _ in range(rng.randint(1, 8))]
        n = rng.randint(1, 3)
        params = SamplingParams(n=n, max_tokens=rng.randint(4, 30), ignore_eos=True)
        seqs += [Sequence(r, i, prompt, params, r * 7 + i) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    cache = {"global": {}, "window": {}}
    steps = preempted = 0
    skipped = []  # window entries released on arrival, per placement that had some
    place = bm.window_group._place
    bm.window_group._place = lambda seq, hits, fresh, count=0, key=None: (
        skipped.append(count) if count else None, place(seq, hits, fresh, count, key))
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        for item in out.scheduled:  # the step's writes first (one forward writes before any read)
            s = item.seq
            for p in range(s.num_computed_tokens, s.num_computed_tokens + item.num_new_tokens):
                content = tuple(s.token_ids[:p + 1])
                cache["global"][bm.slot(s, p)] = content
                cache["window"][bm.window_group.slot(s.window_pages, p)] = content
        for item in out.scheduled:
            s, view = item.seq, item.seq.window_pages
            end = s.num_computed_tokens + item.num_new_tokens
            first = window_block_start(s.num_computed_tokens, window)
            assert view.released_blocks * bs <= first
            for p in range(end):
                assert cache["global"][bm.slot(s, p)] == tuple(s.token_ids[:p + 1])
            for p in range(first, end):
                assert cache["window"][bm.window_group.slot(view, p)] == tuple(s.token_ids[:p + 1])
        sched.postprocess(out.scheduled, [rng.randrange(2, 9) if i.samples else None for i in out.scheduled],
                          [0.0 if i.samples else None for i in out.scheduled])
        steps += 1
        assert steps < 5000
    assert bm.num_shared_hits > 0 and bm.window_group.num_shared_hits > 0 and skipped and preempted > 0
    assert bm.num_free_blocks == 56 and bm.window_group.num_free_blocks == 36
