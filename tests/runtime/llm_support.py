"""Helpers shared by the engine tests (tests/runtime/test_llm*.py)."""

import random

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from vexact_models.kernels import apply_penalties, sample_tokens
from vexact_models.kernels.sampling import filter_thresholds
from vexact_models.runtime import LLM
from vexact_models.runtime.cuda_graphs import StepGraphs
from vexact_models.runtime.model_runner import kv_bytes_per_block

BS = 4


def cache_bytes(model, blocks: int, block_size: int = BS) -> int:
    return blocks * kv_bytes_per_block(model.kv_cache_spec(), block_size, next(model.parameters()).dtype)


def make_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BS)
    kwargs.setdefault("kv_cache_bytes", cache_bytes(model, 256, kwargs["block_size"]))
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("max_num_seqs", 16)
    kwargs.setdefault("device", "cpu")  # CPU tests, even on a machine with a GPU
    return LLM(model, **kwargs)


def word_tokenizer(**special):
    """Token i is the word ``w<i>`` (512 of them); `special`: e.g. ``bos_token="w2"``."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", **special)


def save_chat_checkpoint(path, chat_template: str):
    """A tiny Qwen3 checkpoint at `path` with `word_tokenizer` (w2 its BOS) and `chat_template`."""
    from vexact_models import qwen3

    tokenizer = word_tokenizer(bos_token="w2")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval().save_pretrained(path)
    return path


def gen(llm, prompts, params, **kwargs):
    return llm.generate(prompts, params, use_tqdm=False, **kwargs)


def result(out) -> list[tuple[list[int], list[float], str]]:
    """(token ids, logprobs, finish reason) of every completion of one RequestOutput."""
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]


def prompts_for(n: int, seed: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def training_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    """The training forward's logprobs of `tokens` after `prompt` (ids on the model's device), on the CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        lp = model.token_logprobs(torch.tensor([prompt + tokens], device=device),
                                  temperature=temperature if temperature > 0 else 1.0)
    return lp[0, len(prompt):].cpu()




def training_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The training forward's fp32 logits at each output position of `tokens` after `prompt`."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()


def sampled_by_definition(logits: torch.Tensor, prompt: list[int], tokens: list[int], params) -> list[int]:
    """The token the sampler's definition picks at each output position from `logits` (one row a
    position, already restricted and biased where the request says): penalised from the prompt and
    the outputs before it (`kernels.apply_penalties`), filtered, then Gumbel-max at (the request's
    seed, the output index). The engine's tokens must be these."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    for i in range(1, rows):
        counts[i] = counts[i - 1]
        counts[i, tokens[i - 1]] += 1
    in_prompt = torch.zeros(rows, vocab, dtype=torch.bool)
    in_prompt[:, prompt] = True

    def full(value: float) -> torch.Tensor:
        return torch.full((rows,), value, dtype=torch.float32)

    x = apply_penalties(logits, counts, in_prompt, torch.arange(rows), full(params.repetition_penalty),
                        full(params.frequency_penalty), full(params.presence_penalty))
    temps = full(params.temperature)
    thresholds = filter_thresholds(x, temps, torch.full((rows,), params.top_k), full(params.top_p))
    return sample_tokens(x, temps, torch.full((rows,), params.seed), torch.arange(rows), thresholds).tolist()


def graph_shaped(llm: LLM) -> "CalledGraphs":
    """Give `llm`'s runner `CalledGraphs` of its decode and mixed steps (as `ModelRunner` makes on CUDA)."""
    runner = llm.runner
    graphs = CalledGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_blocks_per_seq,
                          llm.engine_config.max_num_seqs, torch.device("cpu"),
                          max_tokens=llm.engine_config.max_num_batched_tokens, linear_states=runner.linear_states)
    runner.graphs = graphs
    llm._remember_graphs(llm.backend)  # (else generate recaptures: the runner's own, none on the CPU)
    return graphs


class CalledGraphs(StepGraphs):
    """`StepGraphs` whose recorded step is a call of the model on the static buffers at each replay:
    the graphs' host side (buckets, padded buffers, the warm-up's gated-DeltaNet dry run) on the
    CPU, the arithmetic a CUDA graph replays."""

    def _record(self, args, seqs, shared_out):
        vocab = self.model.config.vocab_size  # (a capture runs nothing: no call here, it would advance states)
        out = self.mixed_logits if shared_out else torch.empty(seqs, vocab)
        return _Call(self.model, args, out, seqs), out


class _Call:
    def __init__(self, model, args, out, seqs):
        self.model, self.args, self.out, self.seqs = model, args, out, seqs

    def replay(self):
        self.out[:self.seqs].copy_(self.model(*self.args))

    def reset(self):
        pass


BPE_CORPUS = '{"ok": true, "n": 12} 123-abc (ab) yes no way say "hi"'


def save_bpe_checkpoint(path, eos: int = 0, seed: int = 3, corpus: str = BPE_CORPUS, added_tokens: tuple = (),
                        chat_template: str | None = None, special_tokens: tuple = (), **config):
    """A tiny stock Qwen3 checkpoint at `path` (`config`: overrides of its tiny config) with a
    byte-level BPE tokenizer of 300 tokens, trained on `corpus` (a few words and JSON: "yes", "no
    way", '{"ok": true, ...}'), whose first token ``<eos>`` is the model's EOS `eos` (0);
    `added_tokens`: more whole tokens, not special (as Qwen's ``<tool_call>``); `special_tokens`:
    more, special (as GPT-OSS's harmony markers: decoded only without ``skip_special_tokens``)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    import vexact_models.qwen3 as qwen3

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus] * 20, trainer)
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(qwen3.tiny_config(**{"initializer_range": 0.3, "eos_token_id": eos, **config})
                                  ).eval().save_pretrained(path)
    return path


def tokens_four_ways(make, prompts, params, tight_blocks: int) -> list[list[list[int]]]:
    """Each request's tokens from one batch, each request alone, under a cache of `tight_blocks`
    pages (which must preempt) and with graph-shaped steps; `make(**engine_kwargs)` builds an
    engine. Rows that depend on neither their batch, the cache nor the steps give four equal lists."""
    batch = [o.outputs[0].token_ids for o in gen(make(), prompts, params)]
    alone = [gen(make(), [p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    model = make().model.causal_lm
    tight_llm = make(kv_cache_bytes=cache_bytes(model, tight_blocks), max_num_batched_tokens=8, max_num_seqs=5)
    tight = [o.outputs[0].token_ids for o in gen(tight_llm, prompts, params)]
    assert tight_llm.num_preemptions > 0
    graphed = make()
    graph_shaped(graphed)
    replayed = [o.outputs[0].token_ids for o in gen(graphed, prompts, params)]
    return [batch, alone, tight, replayed]


def count_waiting_samples(monkeypatch) -> list:
    """A list that grows by one each time an engine samples a step launched ahead whose sampling
    waited for the host (`EngineStepsMixin._sample_waiting`), from now on."""
    waited, sample_waiting = [], LLM._sample_waiting
    monkeypatch.setattr(LLM, "_sample_waiting", lambda self, step: waited.append(sample_waiting(self, step)))
    return waited
