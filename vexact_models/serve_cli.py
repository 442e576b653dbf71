"""``vexact serve``: the rollout engine behind an OpenAI-compatible HTTP server (`runtime.openai_server`),
as ``vllm serve`` starts one."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from vexact_models.cli_args import (chat_template_arg, checkpoint_arg, device_arg, non_negative_int, port_arg, positive_float,
                                    positive_int, structured_outputs_config_arg)
from vexact_models.runtime.openai_tools import server_parsers
from vexact_models.runtime.reasoning import PARSERS as REASONING_PARSERS
from vexact_models.runtime.tool_calls import PARSERS

if TYPE_CHECKING:
    from vexact_models.runtime.openai_server import OpenAIServer

__all__ = ["SERVE_HELP", "add_serve_parser", "serve"]

SERVE_HELP = """\
Serve a checkpoint through the OpenAI API, as `vllm serve` does, on the exact-logprob engine:

    vexact serve Qwen/Qwen3-8B --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16, "logprobs": 0, "return_token_ids": true}'

Routes: POST /v1/completions and /v1/chat/completions (streamed with "stream": true), GET /v1/models
and /health, POST /tokenize and /detokenize. Requests join the running batch at the next engine step. Each returned logprob is the
float the training forward's token_logprobs recomputes, bitwise. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, structured_outputs,
return_token_ids, chat_template_kwargs, ...) are read. Tools go to the chat template; with
--tool-call-parser the server reads the calls out of chat replies (tool_choice "auto"), and
tool_choice "required" or a named function holds the reply to the tools' schemas on any model:

    vexact serve Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
    vexact serve Qwen/Qwen3.5-35B-A3B --tool-call-parser qwen3_coder --reasoning-parser deepseek_r1

--reasoning-parser splits a reply's <think> block off into the message's "reasoning" field.

The HTTP front end runs in a process of its own beside the engine's; Ctrl-C or SIGTERM stops both.
"""


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """The ``serve`` sub-command's parser, under `sub` (``vexact``'s sub-parsers)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (as vllm serve)",
                       description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=checkpoint_arg, help="checkpoint folder or hub model id (with its tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=port_arg, default=8000, help="port, 0 to 65535 (default 8000; 0: a free one, printed)")
    p.add_argument("--served-model-name", metavar="NAME", help="the API's model name (default: MODEL as given)")
    p.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the checkpoint's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights and activations (default: the checkpoint's)")
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--max-model-len", type=positive_int, help="prompt + output tokens at most (default: the model's)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences per step at most (default 256)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="tokens per step at most (default 8192)")
    p.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9,
                   help="share of the GPU's memory the process may use; the KV cache takes the rest (default 0.9)")
    p.add_argument("--kv-cache-bytes", type=positive_int, help="KV cache bytes (needed on the CPU beyond 256 MiB)")
    p.add_argument("--max-logprobs", type=non_negative_int, default=20,
                   help="the most alternatives a request's logprobs may ask for (default 20)")
    p.add_argument("--seed", type=int, default=0, help="base seed of requests that give none (default 0)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--prefix-states", type=non_negative_int, default=0, metavar="N",
                   help="gated-DeltaNet models (Qwen3.5, Qwen3-Next): keep up to N prompt and reply states, so that a "
                        "conversation's next turn prefills only what it adds (its last reply too, up to a multiple of 64 "
                        "tokens), and requests that begin alike (a system prompt) compute their common prefix once (each "
                        "takes one sequence's state of the KV budget; default 0: every turn prefills its whole prompt)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="read tool calls out of chat replies in this format: hermes (Qwen2.5, Qwen3, Qwen3-Next, "
                        "QwQ), qwen3_coder (Qwen3-Coder, Qwen3.5), glm45 (GLM-4.5, GLM-4.6), minimax_m2 (MiniMax-M2: "
                        "<minimax:tool_call> invokes), deepseek_v3 / deepseek_v31 "
                        "(DeepSeek-V3, V3.1), "
                        "llama3_json (Llama 3.1), openai (GPT-OSS's harmony messages; brings --reasoning-parser "
                        "openai_gptoss); default: none, tool_choice 'auto' refused"),
    p.add_argument("--chat-template", type=chat_template_arg, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template's text) that chats render with instead of "
                        "the tokenizer's: for checkpoints whose template renders no tools")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="split chat replies' <think> block off into 'reasoning': qwen3 (replies that open it "
                        "themselves: Qwen3's hybrid models), deepseek_r1 (templates that open it in the prompt: "
                        "DeepSeek-R1, Qwen3 thinking-only, Qwen3.5; minimax_m2 reads MiniMax-M2 so), "
                        "minimax_m2_append_think (MiniMax-M2 with its think block kept in the content), "
                        "openai_gptoss (GPT-OSS: the harmony reply's analysis channel, its final channel the content); "
                        "default: none, the reply is all content")
    p.add_argument("--structured-outputs-config", type=structured_outputs_config_arg, metavar="JSON",
                   help="the structured outputs' defaults, vLLM's JSON object: disable_any_whitespace (JSON schemas, "
                        "tools' included, allow no whitespace beyond single separators), enable_in_reasoning (the "
                        "grammar holds the reasoning too; by default it starts after --reasoning-parser's block); "
                        "backend auto or xgrammar. vLLM's dotted form works too: "
                        "--structured-outputs-config.disable_any_whitespace true")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice 'auto', accepted for its command lines: needs "
                        "--tool-call-parser, which turns 'auto' on by itself here")
    return p


def serve(args: argparse.Namespace) -> int:
    """Build the engine from `args` (``add_serve_parser``'s), then serve until interrupted; 2 for a
    user error (`_server`'s ValueError: a checkpoint or setting the engine refuses), 1 where the
    front end cannot listen."""
    try:
        server = _server(args)
    except ValueError as err:  # (before anything is served)
        print(f"vexact serve: error: {err}", file=sys.stderr)
        return 2
    try:
        server.start()
    except RuntimeError as err:  # (the front end's reason: the address in use, ...)
        print(f"vexact serve: error: {err}", file=sys.stderr)
        return 1
    print(f"vexact serve: {server.model_name} at {server.url}", flush=True)
    for stop in (signal.SIGINT, signal.SIGTERM):  # (a parent may have left SIGINT ignored, as pytest-xdist does)
        signal.signal(stop, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("vexact serve: stopped", file=sys.stderr)
    return 0


def _server(args: argparse.Namespace) -> OpenAIServer:
    """The `OpenAIServer` (not started) over the engine `args` describe; a ValueError naming what is
    wrong (the parser options' pairing before the model loads; a hub id not found, an FP8 checkpoint,
    --max-model-len past the model's, a KV budget under one block, no tokenizer, from the engine)."""
    from vexact_models.runtime import LLM
    from vexact_models.runtime.openai_server import OpenAIServer

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({' or '.join(sorted(PARSERS))})")
    server_parsers(args.tool_call_parser, args.reasoning_parser)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_bytes=args.kv_cache_bytes, max_logprobs=args.max_logprobs, seed=args.seed,
              enforce_eager=args.enforce_eager, prefix_states=args.prefix_states)
    return OpenAIServer(llm, args.served_model_name or args.model, args.host, args.port,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        chat_template=args.chat_template, structured_outputs_config=args.structured_outputs_config)


def _interrupt(signum: int, frame) -> None:
    """Ctrl-C and SIGTERM (a process manager's stop) end `serve_forever`, which then closes both processes."""
    raise KeyboardInterrupt
