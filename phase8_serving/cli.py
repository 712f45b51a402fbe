"""The `mini-vllm` command: `serve`, `generate`, `chat`, `bench` (flags named as vLLM names them).

- `mini-vllm serve [MODEL]` (or `--model MODEL`): the OpenAI-compatible server (no MODEL: the
  embedded SmolLM2);
- `mini-vllm generate PROMPT...`: offline replies (through the chat template unless `--no-chat`),
  a token count ticking on stderr meanwhile, then each completion alone under a marker line;
- `mini-vllm chat`: an interactive conversation in the terminal, the reply streamed as it is
  generated (offline: no server involved); Ctrl-C cancels a reply, Ctrl-D or an empty line quits;
- `mini-vllm bench throughput|latency|serve`: vLLM's benchmarks (bench.py), the first two on an
  engine built here, the last against a running server.

Every `EngineConfig` field is a flag of its own (`max_num_seqs` -> `--max-num-seqs`), derived
from the dataclass, so a knob added to the engine is a flag here without touching this file
(phase 7's `--tensor-parallel-size`, alias `-tp`, `--load-format`, `--enforce-eager` among them).
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
import enum
import importlib.metadata
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterator

from .bench import add_bench_parser, run_bench
from .config import EngineConfig

if typing.TYPE_CHECKING:
    from .engine import LLM, LLMEngine, Message, RequestOutput
    from .sampling import SamplingParams
    from .tokenizer import Tokenizer

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no TLS
DEFAULT_PORT = 8000
SHORT_FLAGS = {"tensor_parallel_size": "-tp"}  # vLLM's aliases
OMP_WAIT_POLICY = "PASSIVE"  # threads sleep at a barrier instead of spinning on a shared CPU
log = logging.getLogger(__name__)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none (None: the help says what then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser shows its defaults: subparsers are made of this class too."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-")]
        flags += [SHORT_FLAGS[f.name]] if f.name in SHORT_FLAGS else []
        field_help = f"EngineConfig.{f.name}"
        if hints[f.name] is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default, help=field_help
            )
        elif isinstance(f.default, enum.Enum):  # the config takes the enum's values as strings
            choices = [m.value for m in type(f.default)]
            parser.add_argument(*flags, choices=choices, default=f.default.value, help=field_help)
        else:
            parser.add_argument(*flags, type=hints[f.name], default=f.default, help=field_help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def load_llm(args: argparse.Namespace) -> LLM:
    from .default_model import MODEL_NAME
    from .engine import LLM

    log.info("loading %s", args.model or f"{MODEL_NAME} (its first use converts it, once)")
    return LLM(args.model, dtype=args.dtype, device=args.device, **engine_kwargs(args))


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens at most")
    parser.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p")
    parser.add_argument("--top-k", type=int, default=None, help="default: no top-k filter")
    parser.add_argument("--seed", type=int, default=None, help="default: unseeded")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from .sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip


# -- serve ---------------------------------------------------------------------------------


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the port to listen on")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    p.add_argument("--served-model-name", default=None, help="the name clients use as model")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion cap")
    add_engine_args(p)
    p.set_defaults(handler=serve)


def serve_model(args: argparse.Namespace) -> str | None:
    """The model to serve: the positional MODEL or --model (vLLM takes both), not two."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


def serve(args: argparse.Namespace) -> None:
    import uvicorn  # the server's dependencies load only for `serve`

    from .api_server import ServerConfig, build_app
    from .async_engine import AsyncLLM
    from .default_model import MODEL_NAME

    args.model = serve_model(args)
    llm = load_llm(args)
    engine = llm.engine
    name = args.served_model_name or args.model or MODEL_NAME
    config = ServerConfig(name, resolve_max_model_len(engine, args.max_model_len), args.api_key)
    async_llm = AsyncLLM(engine, name)
    app = build_app(async_llm, config)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
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
        outputs = generate_with_progress(llm.engine, prompts, params)
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


def generate_with_progress(
    engine: LLMEngine, prompts: list, params: SamplingParams
) -> list[RequestOutput]:
    """Runs every prompt to completion, counting generated tokens on stderr as they come."""
    from tqdm.auto import tqdm

    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    counted = dict.fromkeys(ids, 0)
    try:
        with tqdm(desc="generating", unit=" tokens", file=sys.stderr, disable=None) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    num_tokens = len(out.outputs[0].token_ids)
                    bar.update(num_tokens - counted[out.request_id])
                    counted[out.request_id] = num_tokens
                    if out.finished:
                        done[out.request_id] = out
    finally:
        for i in ids:
            engine.abort_request(i)  # Ctrl-C: nothing keeps running; a finished one: no-op
    return [done[i] for i in ids]


# -- chat ----------------------------------------------------------------------------------


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk to a model in the terminal (offline)")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument("--system-prompt", default=None, help="default: the template's own")
    add_sampling_args(p, temperature=0.7, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(handler=chat)


def stream_reply(
    engine: LLMEngine, messages: list[Message], params: SamplingParams
) -> Iterator[str]:
    """Text deltas of the assistant's reply to `messages`, as the engine produces them."""
    from .streaming import DeltaTracker

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
    params = sampling_params(args)
    llm = load_llm(args)
    try:
        converse(llm.engine, params, args.system_prompt, read)
    finally:
        llm.shutdown()


def converse(
    engine: LLMEngine,
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
            with contextlib.closing(stream_reply(engine, messages, params)) as deltas:
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


# -- entry point ---------------------------------------------------------------------------

# Each adds its subparser and sets `handler`.
SUBCOMMANDS = (add_serve_parser, add_generate_parser, add_chat_parser, add_bench)


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
