"""An agent loop with tool calls through the OpenAI API of `vexact serve`, exactly on-policy.

Each episode: a user asks for a sum; the model calls the ``add`` tool (``tool_choice:
"required"``, which holds the reply to the tool's JSON schema, so even a random model calls it),
the script runs the tool and returns its result as a ``tool`` message, and the model answers
(``tool_choice: "none"``). The server holds JSON schemas to no padding whitespace
(``--structured-outputs-config``; ``--any-whitespace`` lifts it, and a random model then pads its
call); a call the reply could not close within ``--max-tokens`` ends the episode after its first turn. Every turn comes back
with its token ids (``return_token_ids``) and logprobs (the engine's floats through JSON). Then:

- each turn's logprobs are recomputed by the training forward (``model.token_logprobs``) from the
  served token ids, and compared bitwise;
- each later turn's prompt is checked for beginning with the earlier turn's prompt and reply
  tokens. It does not where the chat template renders the assistant's call differently from what
  the model wrote (here: the model wrote ``[{"name": ..., "parameters": ...}]``, the template
  renders ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), so a trainer scores each
  turn's served tokens, not a re-tokenized conversation.

The defaults finish in seconds on a CPU: a tiny random Qwen3 with a byte-level BPE tokenizer and a
hermes-style chat template, written to --out. ``--model`` serves a checkpoint of yours instead
(its chat template must render tools and ``tool`` messages). Exits 1 when a recomputed logprob
differs from the served one in any bit; writes ``agent_metrics.json``.

    python examples/agent_tools.py
    python examples/agent_tools.py --model Qwen/Qwen3-0.6B --device cuda --dtype bfloat16 --episodes 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

TEMPLATE = """{%- if tools %}system: <tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}assistant: {{ m.content or '' }}
{%- for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif m.role == 'tool' %}tool: {{ m.content }}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}{%- endfor %}{% if add_generation_prompt %}assistant: {% endif %}"""
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder or hub id to serve (default: a tiny random one written to --out)")
    p.add_argument("--episodes", type=int, default=4, help="agent episodes (default 4)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens a turn may generate (default 200)")
    p.add_argument("--any-whitespace", action="store_true",
                   help="let the call's JSON hold any whitespace (xgrammar's default; a random model pads it past "
                        "--max-tokens); by default the server is started with --structured-outputs-config "
                        "'{\"disable_any_whitespace\": true}'")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights (default float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("agent_out"), help="folder for the checkpoint and metrics")
    args = p.parse_args(argv)
    for name in ("episodes", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.temperature <= 0:
        p.error(f"--temperature must be above 0 (sampled turns), got {args.temperature}")
    return args


def write_checkpoint(path: Path, seed: int, device: str = "cpu") -> Path:
    """A tiny random Qwen3 with a byte-level BPE tokenizer and `TEMPLATE`, in `path` (on a GPU with
    the smallest head size its attention kernels take)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vexact_models import qwen3
    from vexact_models.conformance.models import MIN_GPU_HEAD_DIM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['user: What is 12 plus 30? [{"name": "add", "parameters": {"a": 12, "b": 30}}] '
                             'tool: 42 assistant: The sum is 42.'] * 20, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = qwen3.tiny_config(initializer_range=0.3, eos_token_id=0,
                               **({"head_dim": MIN_GPU_HEAD_DIM} if device.startswith("cuda") else {}))
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def chat(client, messages: list[dict], tool_choice: str, args: argparse.Namespace, seed: int):
    """One turn: the reply's choice, and the turn as (prompt ids, reply ids, reply logprobs)."""
    reply = client.chat.completions.create(
        model="agent", messages=messages, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=args.max_tokens, temperature=args.temperature, seed=seed, logprobs=True,
        extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    extra = choice.model_extra
    return choice, (extra["prompt_token_ids"], extra["token_ids"], [t.logprob for t in choice.logprobs.content])


def episode(client, index: int, args: argparse.Namespace) -> dict:
    """A question, the model's call, the tool's result, the model's answer."""
    rng = random.Random(args.seed * 1000 + index)
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    messages = [{"role": "user", "content": f"What is {a} plus {b}?"}]
    first, turn1 = chat(client, messages, "required", args, seed=args.seed * 1000 + 2 * index)
    if not first.message.tool_calls:  # the reply ran out of tokens before its JSON closed: the episode ends
        return {"question": messages[0]["content"], "call": None, "result": None, "answer": None, "turns": [turn1],
                "continues": None}
    call = first.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    result = arguments["a"] + arguments["b"]  # the tool
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    second, turn2 = chat(client, messages, "none", args, seed=args.seed * 1000 + 2 * index + 1)
    continues = turn2[0][:len(turn1[0]) + len(turn1[1])] == turn1[0] + turn1[1]
    return {"question": messages[0]["content"], "call": f"{call.function.name}({call.function.arguments})",
            "result": result, "answer": second.message.content, "turns": [turn1, turn2], "continues": continues}


@torch.no_grad()
def recompute(model, turns, temperature: float, device: str) -> tuple[int, int]:
    """(tokens checked, mismatches): each turn's reply logprobs against the training forward's."""
    checked = bad = 0
    for prompt, reply, served in turns:
        ids = torch.tensor([prompt + reply], device=device)
        lp = model.token_logprobs(ids, torch.ones_like(ids), temperature=temperature)[0, len(prompt):].tolist()
        checked += len(reply)
        bad += sum(x != y for x, y in zip(lp, served))
    return checked, bad


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import openai
    from transformers import AutoModelForCausalLM

    import vexact_models
    from vexact_models.runtime import LLM
    from vexact_models.runtime.openai_server import OpenAIServer

    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.model or str(write_checkpoint(args.out / "checkpoint", args.seed, args.device))
    llm = LLM(folder, device=args.device, dtype=args.dtype, **({"kv_cache_bytes": 1 << 24} if args.device == "cpu" else {}))
    server = OpenAIServer(llm, "agent", port=0, tool_call_parser="hermes",
                          structured_outputs_config={"disable_any_whitespace": not args.any_whitespace}).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        episodes = [episode(client, i, args) for i in range(args.episodes)]
    finally:
        server.close()
    del llm
    vexact_models.patch()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(args.device).eval()
    checked, bad = recompute(model, [t for e in episodes for t in e["turns"]], args.temperature, args.device)
    for e in episodes:
        if e["call"] is None:
            print(f"{e['question']} -> no call within --max-tokens {args.max_tokens} (the episode ends, its turn scored)")
            continue
        print(f"{e['question']} -> {e['call']} = {e['result']}; answer: {(e['answer'] or '')[:24]!r}...; "
              f"turn 2's prompt continues turn 1's tokens: {'yes' if e['continues'] else 'no'}")
    print(f"recomputed by token_logprobs: {checked} tokens, {bad} mismatches")
    metrics = {"episodes": len(episodes), "called": sum(e["call"] is not None for e in episodes), "tokens": checked,
               "mismatches": bad,
               "continues": [e["continues"] for e in episodes], "calls": [e["call"] for e in episodes]}
    (args.out / "agent_metrics.json").write_text(json.dumps(metrics, indent=1))
    print("RESULT:", "PASS" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
