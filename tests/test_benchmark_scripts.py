"""The benchmark scripts need a GPU to measure; on CPU they must still import, explain
themselves (--help) and refuse cleanly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .script_runner import ScriptRunner

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def scripts():
    """The scripts' usage (--help, refusals, bad options) in one worker process (no GPU visible):
    each run as ``python SCRIPT ARGS`` from benchmarks/ would, without importing torch and
    transformers again (tests/script_runner.py). Runs that do real work keep a process of their own."""
    runner = ScriptRunner()  # its timeout a hang guard: a usage run takes well under a second
    yield runner
    runner.close()


@pytest.mark.parametrize("script", ["kernel_peers.py", "moe.py", "throughput.py", "decode_profile.py", "training.py",
                                    "attention_configs.py", "attention_fa4.py", "sampler.py",
                                    "investigations/attention_order.py", "shared_experts.py", "latent_prefill.py",
                                    "attention_prefill.py", "moe_routing.py", "investigations/head_linear.py",
                                    "investigations/row_kernels.py", "gate_up_silu.py",
                                    "investigations/decode_read_floor.py", "gated_delta.py", "lora.py",
                                    "window_models.py", "lora_expand.py", "multi_turn.py", "generate_batch.py",
                                    "serve.py"])
def test_benchmark_script_help_and_cpu_refusal(scripts, script):
    help_run = scripts.run(BENCHMARKS, script, "--help")
    assert help_run.returncode == 0 and "usage" in (help_run.stdout + help_run.stderr).lower()
    cpu_run = scripts.run(BENCHMARKS, script)
    assert cpu_run.returncode == 2 and "needs a CUDA GPU" in cpu_run.stderr


def test_step_overhead_runs_on_cpu(scripts):
    """benchmarks/step_overhead.py measures host time only: it runs (tiny) on CPU."""
    script = "step_overhead.py"
    help_run = scripts.run(BENCHMARKS, script, "--help")
    assert help_run.returncode == 0 and "--context-len" in help_run.stdout
    run = subprocess.run([sys.executable, script, "--batch", "3,8", "--steps", "3", "--warmup", "1",
                          "--context-len", "20", "--block-size", "4"],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if "schedule" in line).split()
    assert header[:2] == ["batch", "schedule"] and "postprocess" in header
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("3", "8")]
    assert [r[0] for r in rows] == ["3", "8"] and all(len(r) == 9 for r in rows)
    bad = scripts.run(BENCHMARKS, script, "--batch", "0")
    assert bad.returncode == 2


def test_lora_runs_tiny_on_cpu(scripts):
    """benchmarks/lora.py --tiny: every table on CPU, the LoRA rollout and the rollout after the
    adapter-only sync equal their recomputes (0 mismatches), the synced adapters equal the
    trainer's; bad --parts and shapes are usage errors."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "lora.py", "--tiny"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = run.stdout
    for title in ("## rollout", "## training", "## recompute", "## weight sync"):
        assert title in out, out
    lines = out.splitlines()
    rollout = [line.split() for line in lines if line.split()[:1] in (["2"], ["4"]) and line.rstrip().endswith("x")]
    assert [r[0] for r in rollout] == ["2", "4"] and all(r[-1].endswith("x") for r in rollout), out
    assert "4 samples recomputed" in out and ", 0 mismatches" in out
    sync = [line for line in lines if "update_weights" in line and " 28 " in line]
    assert any(line.strip().startswith("stream_full_weights(adapters_only=True)") for line in sync), out
    assert "the engine's adapters equal the trainer's" in out and out.rstrip().endswith("OK")
    for bad, words in ((["--parts", "rollout,x"], "--parts"), (["--train-shape", "8"], "SEQSxTOKENS")):
        refused = scripts.run(BENCHMARKS, "lora.py", "--tiny", *bad)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr


@pytest.mark.parametrize("config, stock", [("gpt-oss-20b", "eager"), ("gemma3-text-default", "sdpa"),
                                           ("olmo3-default", "sdpa")])
def test_window_models_runs_tiny_on_cpu(scripts, config, stock):
    """benchmarks/window_models.py --tiny: the rollout beside HF generate (0 mismatches against the
    recompute), training beside stock HF (eager for GPT-OSS's sinks, sdpa for Gemma 3 and OLMo 3) and the KV
    table (one window of 8 beside full layers: 3 layers, 2 windowed, pages of 16 at 256 tokens:
    48 pages kept, 24 with the windows' freed: a windowed layer keeps the pages from its last
    query's window start rounded down to 64 positions, 4 pages, by the engine's own count); bad
    --parts are usage errors."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "window_models.py", "--tiny", "--config", config], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = run.stdout
    for title in ("## rollout", "## training", "## KV cache"):
        assert title in out, out
    assert f"HF generate ({stock}, batch 3)" in out and f"HF ({stock})" in out
    assert "rollout recomputed: 22 tokens, 0 mismatches" in out and out.rstrip().endswith("OK")
    kv = next(line.split() for line in out.splitlines() if line.split()[:1] == ["256"])
    assert kv[1:4] == ["16", "full,", "8"] and kv[6] == "2.00x" and "the engine's count" in out
    refused = scripts.run(BENCHMARKS, "window_models.py", "--tiny", "--parts", "kv,x")
    assert refused.returncode == 2 and "--parts" in refused.stderr, refused.stderr


def test_throughput_attention_skipped_bound(monkeypatch):
    """`throughput.py --engines aligned-no-attention`: inside `attention_skipped` the attention
    forward returns zeros of the output's shape (value head dim, fp32 lse), and the real kernel
    entry is back afterwards."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput_engines

    module = importlib.import_module("vexact_models.kernels.attention")
    real = module.attention_forward_triton
    q, k, v = torch.randn(5, 4, 24), torch.randn(5, 1, 24), torch.randn(5, 1, 16)
    with throughput_engines.attention_skipped():
        assert module.attention_forward_triton is not real
        out, lse = module.attention_forward_triton(q, k, v, None, 0.1)
    assert module.attention_forward_triton is real
    assert out.shape == (5, 4, 16) and out.dtype == q.dtype and not out.any()
    assert lse.shape == (5, 4) and lse.dtype == torch.float32 and not lse.any()


def test_throughput_step_breakdown(monkeypatch):
    """`throughput.py --step-breakdown`: decode-only and prompt steps are counted, summed and
    their medians taken apart."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput_engines

    times = [(64, True, 0.002), (64, True, 0.004), (64, False, 0.010), (64, True, 0.003), (3, False, 0.030),
             (5, False, 0.020)]
    decode, prompt = throughput_engines.step_breakdown(times).splitlines()
    assert decode.split() == ["decode-only", "steps", "3", "steps", "0.01", "s", "median", "3.00", "ms"]
    assert prompt.split() == ["steps", "with", "prompt", "tokens", "3", "steps", "0.06", "s", "median", "20.00", "ms"]
    assert throughput_engines.step_breakdown([]).split()[2:5] == ["0", "steps", "0.00"]


def test_throughput_graph_counts(monkeypatch):
    """`throughput.py --step-breakdown`: an engine's mixed-step graphs are reported from the real
    `StepGraphs` counters (an eager engine has none)."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput_engines

    from vexact_models.runtime.cuda_graphs import StepGraphs

    counters = SimpleNamespace(num_mixed=3, mixed_capture_seconds=0.456, mixed_replays=17)
    assert {"num_mixed", "mixed_capture_seconds", "mixed_replays"} <= set(StepGraphs.__init__.__code__.co_names)
    assert throughput_engines.graph_counts(counters).split() == ["3", "CUDA", "graphs", "of", "steps", "with", "prompt", "tokens",
                                                          "captured", "in", "0.46", "s", "(all", "runs", "so", "far),",
                                                          "17", "replays"]
    assert throughput_engines.graph_counts(None).strip() == "no CUDA graphs"


def test_linear_quack_config_specs_round_trip_and_bad_ones_are_refused(scripts, monkeypatch):
    """`benchmarks/linear_quack.py --configs`: every default spec parses to the config its label
    names; a bad spec is a usage error naming it, before any GPU check."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import linear_quack

    from vexact_models.kernels.linear_quack import SM90_DEFAULT, QuackConfig

    for spec in linear_quack.DEFAULT_SPECS.split(","):
        assert linear_quack.config_label(linear_quack.parse_config(spec)).split()[0] == spec
    assert linear_quack.parse_config("64x16ps") == QuackConfig(64, 16, True, swap_ab=True)
    assert linear_quack.parse_config("128x128c:1x2") == QuackConfig(128, 128, False, 1, 2)
    assert linear_quack.config_label(SM90_DEFAULT) == "128x192p:2x1 (default)"
    with pytest.raises(ValueError, match="'64x64q'"):
        linear_quack.parse_config("64x64q")
    run = scripts.run(BENCHMARKS, "linear_quack.py", "--configs", "64x64p,12xp")
    assert run.returncode == 2 and "--configs" in run.stderr and "'12xp'" in run.stderr
    run = scripts.run(BENCHMARKS, "linear_quack.py", "--sustained", "-1")
    assert run.returncode == 2 and "--sustained: SECONDS must be >= 0, got -1.0" in run.stderr


def test_linear_quack_times_lm_heads_with_fp32_logits(monkeypatch):
    """`benchmarks/linear_quack.py`: LM heads are timed writing fp32 logits, as the engine's are;
    every other weight in the input's dtype."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import linear_quack

    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    heads = [name for name, _, n in linear_quack.SHAPES if n > 65536]
    assert heads == ["0.6b lm_head", "8b lm_head", "moonlight lm_head"]
    assert all(linear_quack.out_dtype(name, x) == torch.float32 for name in heads)
    assert all(linear_quack.out_dtype(name, x) == torch.bfloat16 for name, _, n in linear_quack.SHAPES if n <= 65536)


@pytest.mark.parametrize("script,option", [("decode_profile.py", "--block-size"), ("throughput.py", "--block-size"),
                                           ("attention_configs.py", "--page-size")])
def test_page_size_options_refuse_values_below_one(scripts, script, option):
    """`bench_utils.positive_int`: the parser names the option, the value and the limit, before
    anything needs a GPU."""
    run = scripts.run(BENCHMARKS, script, option, "0")
    assert run.returncode == 2 and option in run.stderr and "must be >= 1, got 0" in run.stderr


def test_decode_profile_refuses_a_bad_override_before_it_needs_a_gpu(scripts):
    run = scripts.run(BENCHMARKS, "decode_profile.py", "--set", "rope_thta=1")
    assert run.returncode == 2 and "Qwen3Config has no field 'rope_thta'" in run.stderr, run.stderr


def test_decode_profile_takes_a_lora_rank(scripts):
    """decode_profile.py --lora RANK (the step under random PEFT adapters): listed by --help, a rank
    below 1 refused by the parser before anything needs a GPU."""
    help_run = scripts.run(BENCHMARKS, "decode_profile.py", "--help")
    assert help_run.returncode == 0 and "--lora RANK" in help_run.stdout
    run = scripts.run(BENCHMARKS, "decode_profile.py", "--lora", "0")
    assert run.returncode == 2 and "--lora" in run.stderr and "must be >= 1, got 0" in run.stderr


@pytest.mark.parametrize("script,option", [("sampler.py", "--rows"), ("linear_quack.py", "--ms"),
                                           ("moe_routing.py", "--tokens"),
                                           ("investigations/row_kernels.py", "--tokens"), ("gate_up_silu.py", "--ms")])
@pytest.mark.parametrize("value,words", [("128,x", "expected comma-separated integers"), ("64,0", "must be >= 1")])
def test_count_list_options_refuse_bad_values(scripts, script, option, value, words):
    """`bench_utils.positive_ints`: the parser names the option, the value and what it expected,
    before anything needs a GPU."""
    run = scripts.run(BENCHMARKS, script, option, value)
    assert run.returncode == 2 and option in run.stderr and words in run.stderr and repr(value) in run.stderr


@pytest.mark.parametrize("script,form", [("latent_prefill.py", "ROWSxWARPSxSTAGES"),
                                         ("attention_prefill.py", "STAGESxCONSUMER_REGSxPRODUCER_REGS")])
@pytest.mark.parametrize("value,words", [("64x4", "a candidate is {}"),
                                         ("64x4x3,64x0x3", "must be >= 1, got '64x0x3'")])
def test_gluon_candidate_options_refuse_bad_values(scripts, script, form, value, words):
    """`bench_utils.gluon_candidates`: the parser names the option and the bad candidate before
    anything needs a GPU."""
    run = scripts.run(BENCHMARKS, script, "--candidates", value)
    assert run.returncode == 2 and "--candidates" in run.stderr and words.format(form) in run.stderr


def test_attention_config_cases_are_named_by_their_shape(monkeypatch):
    """Every attention_configs.py case ends in "<sequences>x<tokens>", its own shape, and no name
    is a substring of another, so that `--cases` (substrings) can pick any one case by its name."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import attention_configs

    for cases in (attention_configs.LATENT_CASES, attention_configs.GQA_CASES):
        names = [case[0] for case in cases]
        for name, _, _, _, _, _, seqs, tokens in cases:
            assert name.endswith(f" {seqs}x{tokens}"), name
            assert [other for other in names if name in other] == [name], name


@pytest.mark.parametrize("value", ["64x64x4", "64x64x4x3,16xAx2x3", "0x64x4x3"])
def test_head_linear_tiles_option_refuses_bad_values(scripts, value):
    """`--tiles` names the bad candidate and the form it expected, before anything needs a GPU."""
    run = scripts.run(BENCHMARKS, "investigations/head_linear.py", "--tiles", value)
    assert run.returncode == 2 and "--tiles" in run.stderr and "must be BLOCK_MxBLOCK_NxWARPSxSTAGES" in run.stderr


TINY_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def test_throughput_peer_config_runs_tiny_on_cpu():
    """benchmarks/throughput.py --tiny --peer-config: Qwen3.5-MoE (a gated-DeltaNet hybrid) beside
    stock HF generate (its torch delta rule here, fla not installed) and beside Qwen3-MoE on the
    same workload, one model at a time, the ratio printed; the hybrid's floor counts its GDN state."""
    run = subprocess.run([sys.executable, "throughput.py", "--tiny", "--config", "qwen3.5-35b-a3b", "--peer-config",
                          "qwen3-30b-a3b", "--requests", "4", "--step-breakdown"],  # --tiny's engines: aligned,hf
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=600, env=TINY_ENV)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = run.stdout
    assert "qwen3.5-35b-a3b tiny (3 layers) beside qwen3-30b-a3b tiny (3 layers), 4 requests" in out
    assert "gated DeltaNet: 2 of 3 layers hold a state instead of KV pages" in out and "KV + GDN state s" in out
    assert "HF generate (batch 64, torch delta rule)" in out  # the same 4 requests as ours
    assert out.count("decode-only steps") == 2  # --step-breakdown on both models' engines
    peer = out.split("## qwen3.5-35b-a3b tiny (3 layers) beside qwen3-30b-a3b tiny (3 layers)")[1].splitlines()
    row = next(line.split() for line in peer if line.strip().startswith("vexact aligned"))
    ours, theirs = (float(v.replace(",", "")) for v in row[2:4])
    assert row[4].endswith("x") and float(row[4][:-1]) == pytest.approx(ours / theirs, abs=0.02)  # rates printed rounded


def test_throughput_sampling_option_engines_run_tiny_on_cpu():
    """benchmarks/throughput.py --engines aligned,aligned-top20,aligned-penalties,aligned-regex,
    aligned-regex-sync,generate,generate-whole: the same workload's output tokens with
    ``SamplingParams(logprobs=20)`` asked for, with the penalties, with a regex that never completes
    (with steps ahead and one step at a time), and through HF's ``generate`` on our model with and
    without its KV cache, each a row of its own beside the plain engine's; and transformers'
    ``generate_batch`` on ours and on the stock class, both all requests to one length."""
    engines = ("aligned,aligned-top20,aligned-penalties,aligned-regex,aligned-regex-sync,generate,generate-whole,"
               "generate-batch,hf-generate-batch")
    run = subprocess.run([sys.executable, "throughput.py", "--tiny", "--engines", engines,
                          "--requests", "3"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600, env=TINY_ENV)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    rows = {line[:60].strip(): line[60:].split() for line in run.stdout.splitlines()
            if line.startswith("vexact ") and ":" not in line}  # the table's rows
    names = ["vexact aligned", "vexact aligned, logprobs=20", "vexact aligned, penalties",
             "vexact aligned, structured outputs (regex)", "vexact aligned, structured outputs (regex), sync",
             "vexact model, HF's generate (batch 64)",
             "vexact model, HF's generate, use_cache=False (batch 64)"]
    batch = {line[:60].strip(): line[60:].split() for line in run.stdout.splitlines()
             if line.startswith(("vexact", "HF")) and "generate_batch (one call" in line and ":" not in line}
    assert [name.split(" (")[0] for name in batch] == ["vexact model, generate_batch", "HF generate_batch"]
    assert len({row[1] for row in batch.values()}) == 1 and batch[next(iter(batch))][1] != rows[names[0]][1]
    assert set(rows) == set(names) | {next(iter(batch))}
    assert len({rows[name][1] for name in names}) == 1  # the same output tokens on every row
    bad = subprocess.run([sys.executable, "throughput.py", "--tiny", "--engines", "aligned-regex", "--requests", "2",
                          "--regex", "([a-z"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600, env=TINY_ENV)
    assert bad.returncode != 0 and "structured_outputs.regex='([a-z' does not compile" in bad.stderr  # --regex is used


@pytest.mark.parametrize("argv,words", [
    (["--peer-config", "nope"], "--peer-config 'nope': config 'nope': no such file"),
    (["--peer-config", "qwen3-30b-a3b:0"], "--peer-config 'qwen3-30b-a3b:0': --configs 'qwen3-30b-a3b:0': the layer "
                                            "count after ':' must be a positive integer"),
    (["--peer-config", "qwen3-30b-a3b", "--engines", "hf"], "--engines=hf has none"),
    (["--config", "nope"], "--config 'nope': config 'nope'"),
    (["--config", "qwen3-0.6b", "--mla-kv-cache", "latent"], "--mla-kv-cache: qwen3-0.6b is not an MLA model"),
    (["--engines", "aligned,bogus"], "--engines: unknown engine 'bogus'"),
    (["--requests", "0"], "--requests: must be >= 1, got 0"),
    (["--tiny", "--engines", "aligned,fast"], "--engines: fast needs a CUDA GPU, and --tiny runs on CPU"),
    (["--set", "num_hidden_layer=2"], "config override num_hidden_layer=2: Qwen3Config has no field 'num_hidden_layer'"),
    (["--config", "qwen3-30b-a3b", "--peer-config", "qwen3-0.6b", "--set", "num_experts=8"],
     "Qwen3Config has no field 'num_experts'"),  # the peer's config is checked too
    (["--tiny", "--set", "foo"], "--set 'foo': expected KEY=VALUE"),
])
def test_throughput_refuses_bad_models_and_engines(scripts, argv, words):
    """throughput.py names the option and the value of a bad model or engine choice before building
    anything (and before it needs a GPU)."""
    run = scripts.run(BENCHMARKS, "throughput.py", *argv)
    assert run.returncode == 2 and words in run.stderr, run.stderr


def test_shared_experts_blocks_and_header(monkeypatch):
    """`shared_experts.py`'s MoE blocks: each model type's class exists and has the shared experts'
    call the script times; the header names the routed and shared experts; a config without
    shared experts is refused by name."""
    import importlib

    from vexact_models.conformance.models import architecture_of, make_config

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import shared_experts

    for model_type, (module, name, call) in shared_experts.MOE_BLOCKS.items():
        block = getattr(importlib.import_module(module), name)
        assert callable(getattr(block, call, None)) or call == "shared_experts", (model_type, call)
    qwen = make_config(architecture_of("qwen3.5-35b-a3b"), "qwen3.5-35b-a3b")
    assert shared_experts.describe(qwen) == "256 routed experts top-8, gated shared expert of 512"
    moonlight = make_config(architecture_of("moonlight-16b-a3b"), "moonlight-16b-a3b")
    assert shared_experts.describe(moonlight) == "64 routed experts top-6, shared MLP of 2816"
    with pytest.raises(SystemExit, match="--config qwen3-8b: a config with shared experts is needed"):
        shared_experts.build_layers("qwen3-8b", 1)


def test_grammar_masks_benchmark_runs_tiny_on_cpu():
    """benchmarks/grammar_masks.py: per regex and step, the host fills and our mask application
    beside xgrammar's (which it checks gives the same bits); bad sizes are refused."""
    pytest.importorskip("xgrammar")
    run = subprocess.run([sys.executable, "grammar_masks.py", "--rows", "4", "--vocab", "500", "--steps", "2",
                          "--device", "cpu"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, env=TINY_ENV)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("([a-z]")]
    assert len(rows) == 4 and all(row[-1].endswith("x") for row in rows)
    bad = subprocess.run([sys.executable, "grammar_masks.py", "--rows", "0"], cwd=BENCHMARKS, capture_output=True,
                         text=True, timeout=300, env=TINY_ENV)
    assert bad.returncode == 2 and "--rows 0" in bad.stderr
