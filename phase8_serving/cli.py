"""The `mini-vllm` command: `serve`, `engine-core`, `generate`, `chat`, `bench`, `replay` (flags
named as vLLM names them).

- `mini-vllm serve [MODEL]` (or `--model MODEL`): the OpenAI-compatible server (no MODEL: the
  embedded SmolLM2): a front end process and `--data-parallel-size` engine core processes it
  spawns, or, with `--engine-core-address`, engine cores started elsewhere; on SIGTERM or Ctrl-C
  it stops accepting connections, lets in-flight requests run for at most `--shutdown-timeout`
  seconds (vLLM's flag; 0, the default, aborts them at once), then exits;
- `mini-vllm engine-core [MODEL] --address tcp://HOST:PORT`: one engine core on its own, for a
  front end on this machine or another to connect to;
- `mini-vllm generate PROMPT...`: offline replies (through the chat template unless `--no-chat`),
  a token count ticking on stderr meanwhile, then each completion alone under a marker line;
- `mini-vllm chat`: an interactive conversation in the terminal, the reply streamed as it is
  generated (offline: no server involved); Ctrl-C cancels a reply, Ctrl-D or an empty line quits;
- `mini-vllm bench throughput|latency|serve`: vLLM's benchmarks (bench.py), the first two on an
  engine built here, the last against a running server;
- `mini-vllm replay TRACE.json`: the dashboard's page on a step trace that phases 4-8 record
  (replay.py), with a step slider.

The flags are vLLM's: every `EngineConfig` field is one (arg_utils.py). `serve` and
`engine-core` live in serve.py, `bench` in bench.py; `generate`, `chat` and `replay` here.
Subcommands live in `SUBCOMMANDS`: one function each that adds its parser and sets its handler.
`--help` shows every default.

The engine is imported inside the handlers, not at the top (and the package imports its names on
first use): `main` first sets OpenMP's wait policy to PASSIVE unless the user chose one, which
libgomp reads only once, when torch loads it. Spinning threads on a CPU shared with other work
lose most of their time (benchmarks/README.md, "Threads").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterator

from .arg_utils import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Parser,
    add_engine_args,
    add_sampling_args,
    load_llm,
    sampling_params,
)
from .bench import add_bench_parser, run_bench
from .serve import add_engine_core_parser, add_serve_parser

if typing.TYPE_CHECKING:
    from .engine import LLM, Message, RequestOutput
    from .sampling_params import SamplingParams
    from .tokenizer import Tokenizer

OMP_WAIT_POLICY = "PASSIVE"  # threads sleep at a barrier instead of spinning on a shared CPU
log = logging.getLogger(__name__)


# -- generate ------------------------------------------------------------------------------


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="reply to prompts offline and print the text")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True,
        help="each prompt is a user message in the chat template; --no-chat: complete raw text",
    )  # fmt: skip
    add_sampling_args(p, temperature=0.0, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(handler=generate)


def generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # before the slow load: a bad flag fails at once
    llm = load_llm(args)
    try:
        prompts = (
            [user_turn(llm.get_tokenizer(), p) for p in args.prompt] if args.chat else args.prompt
        )
        outputs = generate_with_progress(llm, prompts, params)
        for i, out in enumerate(outputs, start=1):
            completion = out.outputs[0]
            tokens, reason = len(completion.token_ids), completion.finish_reason
            print(f"--- completion {i} of {len(outputs)} ({tokens} tokens, finish: {reason}) ---")
            print(completion.text)
    finally:
        llm.shutdown()


def user_turn(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as one user message through the chat template, ready for the assistant's reply."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template: pass --no-chat")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)  # the template holds them


def generate_with_progress(llm: LLM, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    """Runs every prompt to completion, counting generated tokens on stderr as they come."""
    from tqdm.auto import tqdm

    ids = [llm.add_request(p, params) for p in prompts]  # deltas, each step
    deltas: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    try:
        with tqdm(desc="generating", unit=" tokens", file=sys.stderr, disable=None) as bar:
            while llm.has_unfinished_requests():
                for out in llm.step():
                    bar.update(len(out.outputs[0].token_ids))
                    deltas[out.request_id].append(out)
    finally:
        for i in ids:
            llm.abort_request(i)  # Ctrl-C: nothing keeps running; a finished one: no-op
    return [whole(deltas[i]) for i in ids]


def whole(deltas: list[RequestOutput]) -> RequestOutput:
    """A request's deltas, in order, as one output."""
    from .engine import CompletionOutput

    parts = [d.outputs[0] for d in deltas]
    logprobs = None if parts[0].logprobs is None else [p for c in parts for p in c.logprobs]
    text, token_ids = "".join(c.text for c in parts), [t for c in parts for t in c.token_ids]
    completion = CompletionOutput(0, text, token_ids, parts[-1].finish_reason, logprobs)
    return dataclasses.replace(deltas[-1], outputs=[completion])


# -- chat ----------------------------------------------------------------------------------


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk to a model in the terminal (offline)")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument("--system-prompt", default=None, help="default: the template's own")
    add_sampling_args(p, temperature=0.7, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(handler=chat)


def stream_reply(llm: LLM, messages: list[Message], params: SamplingParams) -> Iterator[str]:
    """Text deltas of the assistant's reply to `messages`, as the engine produces them (the
    output processor holds back what a stop string may still remove: output_processor.py)."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    request_id = llm.add_request(prompt, params)
    try:
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id == request_id:
                    yield out.outputs[0].text
    finally:
        llm.abort_request(request_id)  # Ctrl-C mid-reply frees its blocks; no-op when done


def chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> None:
    params = sampling_params(args)
    llm = load_llm(args)
    try:
        converse(llm, params, args.system_prompt, read)
    finally:
        llm.shutdown()


def converse(
    llm: LLM,
    params: SamplingParams,
    system_prompt: str | None,
    read: Callable[[str], str],
) -> None:
    """The chat loop. Ctrl-C during a reply cancels it (the turn is forgotten) and asks again;
    Ctrl-C or Ctrl-D at the prompt, or an empty line, ends the conversation."""
    messages: list[Message] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    print("Type a message. Ctrl-C stops a reply; an empty line or Ctrl-D quits.")
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print()  # the shell's prompt starts on a line of its own
            return
        if not line.strip():
            return
        messages.append({"role": "user", "content": line})
        reply = ""
        try:  # closing: the request is aborted (its blocks freed) the moment the loop stops
            with contextlib.closing(stream_reply(llm, messages, params)) as deltas:
                for delta in deltas:
                    reply += delta
                    print(delta, end="", flush=True)
        except KeyboardInterrupt:
            messages.pop()
            print(" [cancelled]")
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


# -- bench ---------------------------------------------------------------------------------


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    """`bench throughput|latency` build their engine here: a model and the engine's flags."""
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    add_engine_args(parser)


def add_bench(subparsers) -> None:
    add_bench_parser(subparsers, add_bench_engine_args)
    subparsers.choices["bench"].set_defaults(handler=bench)


def bench(args: argparse.Namespace) -> None:
    llms: list[LLM] = []

    def make_llm(args: argparse.Namespace) -> LLM:
        llms.append(load_llm(args))
        return llms[-1]

    try:
        run_bench(args, make_llm)
    finally:
        for llm in llms:
            llm.shutdown()


# -- replay --------------------------------------------------------------------------------


def add_replay_parser(subparsers) -> None:
    p = subparsers.add_parser("replay", help="the dashboard on a recorded step trace")
    p.add_argument("trace", help="a trace JSON written by StepTrace.to_chrome() (phases 4-8)")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.set_defaults(handler=replay)


def replay(args: argparse.Namespace) -> None:
    import uvicorn

    from .replay import build_replay_app

    app = build_replay_app(args.trace)  # a bad file fails here, before the server starts
    print(f"replaying {args.trace} at http://{args.host}:{args.port}/dashboard", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


# -- entry point ---------------------------------------------------------------------------

# Each adds its subparser and sets `handler`.
SUBCOMMANDS = (
    add_serve_parser, add_engine_core_parser, add_generate_parser, add_chat_parser, add_bench,
    add_replay_parser,
)  # fmt: skip


def version() -> str:
    try:
        return importlib.metadata.version("mini-vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: .ci/setup installs it)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mini-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mini-vllm {version()}")
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def set_omp_wait_policy(environ: typing.MutableMapping[str, str] = os.environ) -> None:
    """PASSIVE unless the user chose a policy; only effective before torch is imported."""
    environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)


def main(argv: list[str] | None = None) -> None:
    set_omp_wait_policy()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad flags or model: no traceback
        sys.exit(f"mini-vllm: error: {e}")
