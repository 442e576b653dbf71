"""A MoE layer with its shared experts in line (one stream) and on the side stream beside the router
and routed experts (`vexact_models.side_stream`, the default in CUDA-graph captures without
autograd), at decode and prefill token counts: DeepSeek-V3 / Moonlight (shared experts) and
Qwen3.5-MoE / Qwen3-Next (a shared expert scaled by its sigmoid gate).

Each row times `--layers` distinct random layers back to back in a CUDA graph (so the experts'
weights come from HBM, as in a decode step) in both placements, and the routed experts alone and
the shared experts alone for reference. "same bits" compares every layer's output of the two
placements, each from a replay of its graph (the side stream forks only in CUDA-graph captures):
the same kernels read the same inputs, so it must read "yes".

Usage:
    python benchmarks/shared_experts.py                                   # Moonlight-16B-A3B
    python benchmarks/shared_experts.py --config deepseek-v3 --layers 2 --tokens 16,64,256
    python benchmarks/shared_experts.py --config qwen3.5-35b-a3b --tokens 64,256,8192
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import bench_graph, capture_graph, positive_int, positive_ints, table


#: the MoE block of each model type with shared experts: (module, class, its shared experts' call)
MOE_BLOCKS = {"deepseek_v3": ("vexact_models.deepseek_v3.modeling", "DeepseekV3MoE", "shared_experts"),
              "qwen3_5_moe_text": ("vexact_models.qwen3_5_moe.modeling", "Qwen3_5MoeSparseMoeBlock",
                                   "gated_shared_expert"),
              "qwen3_next": ("vexact_models.qwen3_next.modeling", "Qwen3NextSparseMoeBlock", "gated_shared_expert")}


def build_layers(config_name: str, count: int) -> tuple[list, object]:
    """`count` MoE layers of the published config, random weights (std 0.02; a nonzero router
    bias where the router has one), bf16 on the GPU. SystemExit for a config without shared
    experts (`MOE_BLOCKS`)."""
    import importlib

    from vexact_models.conformance.models import architecture_of, construct, make_config

    config = make_config(architecture_of(config_name), config_name)
    if config.model_type not in MOE_BLOCKS:
        raise SystemExit(f"--config {config_name}: a config with shared experts is needed (model types "
                         f"{sorted(MOE_BLOCKS)}), got model_type {config.model_type!r}")
    module, name, _ = MOE_BLOCKS[config.model_type]
    block = getattr(importlib.import_module(module), name)
    torch.manual_seed(0)
    layers = []
    for _ in range(count):
        layer = construct(block, config, torch.device("cuda"), torch.bfloat16).eval()
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.02)
            bias = getattr(layer.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.1)
        layers.append(layer)
    return layers, config


def describe(config) -> str:
    """The routed and shared experts of `config`, for the header."""
    if config.model_type == "deepseek_v3":
        return (f"{config.n_routed_experts} routed experts top-{config.num_experts_per_tok}, shared MLP of "
                f"{config.moe_intermediate_size * config.n_shared_experts}")
    return (f"{config.num_experts} routed experts top-{config.num_experts_per_tok}, gated shared expert of "
            f"{config.shared_expert_intermediate_size}")


def time_placements(layers: list, hidden: int, tokens: int, layer_type: str = "deepseek_v3") -> list:
    """One table row: microseconds per layer in line, beside, routed alone and shared alone
    (`layer_type`: the config's model type, a key of `MOE_BLOCKS`)."""
    from vexact_models.side_stream import SHARED_EXPERTS

    xs = [torch.randn(tokens, hidden, device="cuda").bfloat16() for _ in layers]

    def placed(mode):
        def run(layer, x):
            with SHARED_EXPERTS.use(mode):
                return layer(x)
        return run

    def routed(layer, x):
        _, weights, ids = layer.gate(x)
        return layer.experts(x, ids, weights)

    def shared(layer, x):
        return getattr(layer, MOE_BLOCKS[layer_type][2])(x)

    def graph_outputs(fn) -> list:
        """Each layer's output from a replay of their graph (the side stream forks only in captures)."""
        outs = []
        graph = capture_graph([lambda layer=layer, x=x: outs.append(fn(layer, x)) for layer, x in zip(layers, xs)])
        graph.replay()
        torch.cuda.synchronize()
        return outs[len(layers):]  # after the warm-up's eager outputs

    times, outs = {}, {}
    for label, fn in (("inline", placed("inline")), ("side", placed("side")), ("routed", routed), ("shared", shared)):
        outs[label] = graph_outputs(fn)
        # bench_graph gives the time of one of its functions: one layer's
        times[label] = bench_graph([lambda layer=layer, x=x: fn(layer, x) for layer, x in zip(layers, xs)], reps=4) * 1e3
    same = all(torch.equal(a, b) for a, b in zip(outs["inline"], outs["side"]))
    return [tokens, f"{times['inline']:.1f}", f"{times['side']:.1f}", f"{times['inline'] / times['side']:.3f}x",
            f"{times['routed']:.1f}", f"{times['shared']:.1f}", "yes" if same else "NO"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", default="moonlight-16b-a3b",
                        help="a bundled config with shared experts (DeepSeek-V3, Qwen3.5-MoE, Qwen3-Next types) or "
                             "a config.json path (moonlight-16b-a3b)")
    parser.add_argument("--tokens", type=positive_ints, default=[16, 64, 128, 256, 1024, 8192],
                        help="tokens per layer call: decode batches and prefill chunks (16,64,128,256,1024,8192)")
    parser.add_argument("--layers", type=positive_int, default=4,
                        help="distinct layers per graph, so that weights come from HBM (4; DeepSeek-V3: 2 fit an H200)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("shared_experts.py needs a CUDA GPU", file=sys.stderr)
        return 2
    layers, config = build_layers(args.config, args.layers)
    with torch.no_grad():
        rows = [time_placements(layers, config.hidden_size, tokens, config.model_type) for tokens in args.tokens]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.config}: {describe(config)}; "
          f"{args.layers} layers a graph")
    table("one MoE layer, microseconds (CUDA graph)",
          ["tokens", "in line", "side stream", "speed-up", "routed only", "shared only", "same bits"], rows)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
