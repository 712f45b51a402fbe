"""The `mini-vllm` command: `serve`, `generate`, `chat`, `bench` (flags named as vLLM names them).

- `mini-vllm serve [MODEL]`: the OpenAI-compatible server (no MODEL: the embedded SmolLM2);
- `mini-vllm generate PROMPT...`: offline completions, printed;
- `mini-vllm chat`: an interactive conversation in the terminal, the reply streamed as it is
  generated (offline: no server involved);
- `mini-vllm bench throughput|latency|serve`: vLLM's benchmarks (bench.py), the first two on an
  engine built here, the last against a running server;
- `mini-vllm replay TRACE.json`: the dashboard's page on a step trace that phases 4-8 record
  (replay.py), with a step slider.

Every `EngineConfig` field is a flag of its own (`max_num_seqs` -> `--max-num-seqs`), derived
from the dataclass, so a knob added to the engine is a flag here without touching this file
(phase 7's `--tensor-parallel-size`, `--load-format`, `--enforce-eager` among them).
Subcommands live in `SUBCOMMANDS`: one function each that adds its parser and sets its handler.
"""

import argparse
import dataclasses
import enum
import logging
import sys
import typing
from collections.abc import Callable, Iterator

from .bench import add_bench_parser, run_bench
from .config import EngineConfig
from .default_model import MODEL_NAME
from .engine import LLM, LLMEngine, Message
from .sampling import SamplingParams
from .streaming import DeltaTracker

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no TLS
DEFAULT_PORT = 8000


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif isinstance(f.default, enum.Enum):  # the config takes the enum's values as strings
            choices = [m.value for m in type(f.default)]
            parser.add_argument(flag, choices=choices, default=f.default.value)
        else:
            parser.add_argument(flag, type=hints[f.name], default=f.default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def load_llm(args: argparse.Namespace) -> LLM:
    return LLM(args.model, dtype=args.dtype, device=args.device, **engine_kwargs(args))


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip


# -- serve ---------------------------------------------------------------------------------


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument(
        "model", nargs="?", default=None, help="HF directory or hub id (default: SmolLM2)"
    )
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    p.add_argument("--served-model-name", default=None, help="the name clients use as model")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion cap")
    p.add_argument(
        "--disable-dashboard", action="store_true", help="do not serve the /dashboard page"
    )
    add_engine_args(p)
    p.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> None:
    import uvicorn  # the server's dependencies load only for `serve`

    from .api_server import ServerConfig, build_app
    from .async_engine import AsyncLLM

    llm = load_llm(args)
    engine = llm.engine
    name = args.served_model_name or args.model or MODEL_NAME
    max_model_len = resolve_max_model_len(engine, args.max_model_len)
    config = ServerConfig(name, max_model_len, args.api_key, not args.disable_dashboard)
    async_llm = AsyncLLM(engine, name)
    app = build_app(async_llm, config)
    url = f"http://{args.host}:{args.port}"
    logging.getLogger(__name__).info("serving %s on %s", name, url)
    if config.enable_dashboard:
        key = "?key=KEY" if args.api_key else ""
        logging.getLogger(__name__).info("dashboard: %s/dashboard%s", url, key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        async_llm.shutdown()
        llm.shutdown()  # stops the tensor-parallel workers, if any


def resolve_max_model_len(engine: LLMEngine, requested: int | None) -> int:
    """The model's context, or less when asked; never more than the KV cache can ever hold."""
    limit = min(engine.model.config.max_position_embeddings, engine.config.num_kv_slots)
    if requested is None:
        return limit
    if not 2 <= requested <= limit:
        raise ValueError(
            f"--max-model-len must be in [2, {limit}] (the model's context and the KV cache), "
            f"got {requested}"
        )
    return requested


# -- generate ------------------------------------------------------------------------------


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete prompts offline and print the text")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    add_sampling_args(p, temperature=0.0)
    add_engine_args(p)
    p.set_defaults(handler=generate)


def generate(args: argparse.Namespace) -> None:
    llm = load_llm(args)
    try:
        for out in llm.generate(args.prompt, sampling_params(args), use_tqdm=False):
            completion = out.outputs[0]
            print(f"--- {out.prompt!r} ({completion.finish_reason})")
            print(out.prompt + completion.text)
    finally:
        llm.shutdown()


# -- chat ----------------------------------------------------------------------------------


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk to a model in the terminal (offline)")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument("--system-prompt", default=None)
    add_sampling_args(p, temperature=0.7)
    add_engine_args(p)
    p.set_defaults(handler=chat)


def stream_reply(
    engine: LLMEngine, messages: list[Message], params: SamplingParams
) -> Iterator[str]:
    """Text deltas of the assistant's reply to `messages`, as the engine produces them."""
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    request_id = engine.add_request(prompt, params)
    tracker = DeltaTracker(params.stop)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    yield tracker.update(out.outputs[0], out.finished).text
    finally:
        engine.abort_request(request_id)  # Ctrl-C mid-reply frees its blocks; no-op when done


def chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> None:
    llm = load_llm(args)
    try:
        converse(llm.engine, args, read)
    finally:
        llm.shutdown()


def converse(engine: LLMEngine, args: argparse.Namespace, read: Callable[[str], str]) -> None:
    params = sampling_params(args)
    messages: list[Message] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    print("Type a message; an empty line or Ctrl-D quits.")
    while True:
        try:
            line = read("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        for delta in stream_reply(engine, messages, params):
            reply += delta
            print(delta, end="", flush=True)
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
SUBCOMMANDS = (add_serve_parser, add_generate_parser, add_chat_parser, add_bench, add_replay_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini-vllm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags or a bad model path: no traceback
        sys.exit(f"mini-vllm: error: {e}")
