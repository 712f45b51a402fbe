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

Every `EngineConfig` field is a flag of its own (`max_num_seqs` -> `--max-num-seqs`), derived
from the dataclass, so a knob added to the engine is a flag here without touching this file
(phase 7's `--tensor-parallel-size`, alias `-tp`, `--load-format`, `--enforce-eager`, and the KV
cache's `--gpu-memory-utilization`, `--kv-cache-memory-bytes`, `--num-kv-blocks` among them; vLLM's
`--num-gpu-blocks-override` is another name for the last). A field that may be None (the engine
chooses) is a flag that may be left out.
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
import signal
import sys
import typing
from collections.abc import Callable, Iterator

from .bench import add_bench_parser, run_bench
from .config import EngineConfig

if typing.TYPE_CHECKING:
    from .engine import LLM, LLMEngine, Message, RequestOutput
    from .engine_core import CoreInfo, EngineCoreSpec
    from .sampling import SamplingParams
    from .tokenizer import Tokenizer

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no TLS
DEFAULT_PORT = 8000
# vLLM's other names for a flag, where it has them
FLAG_ALIASES = {"tensor_parallel_size": ("-tp",), "num_kv_blocks": ("--num-gpu-blocks-override",)}
# uvicorn's wait with a timeout of exactly 0 is cancelled before it can see that nothing is
# running, and logs an error even for an idle server; a tick is "at once" for any request.
SHUTDOWN_TICK_S = 0.01
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
        flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
        field_help = f"EngineConfig.{f.name}"
        if f.default is None:  # the engine chooses (kv_cache_config.py, EngineConfig.for_device)
            field_help += " (default: the device's)"
        if hints[f.name] is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default, help=field_help
            )
        elif isinstance(f.default, enum.Enum):  # the config takes the enum's values as strings
            choices = [m.value for m in type(f.default)]
            parser.add_argument(*flags, choices=choices, default=f.default.value, help=field_help)
        else:
            parser.add_argument(
                *flags, type=value_type(hints[f.name]), default=f.default, help=field_help
            )


def value_type(hint) -> type:
    """`int | None` -> int: a flag left out keeps the default None (the engine chooses)."""
    types = [t for t in typing.get_args(hint) if t is not type(None)]
    return types[0] if types else hint


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
    p.add_argument("--shutdown-timeout", type=seconds, default=0.0,
                   help="seconds in-flight requests may run after SIGTERM before they are "
                   "aborted (0: at once)")  # fmt: skip
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine cores behind this front end, each on its own GPU(s)")  # fmt: skip
    p.add_argument("--engine-core-address", nargs="+", default=None, metavar="ADDRESS",
                   help="connect to engine cores started with `mini-vllm engine-core` instead of "
                        "spawning them (tcp://HOST:PORT or ipc://PATH)")  # fmt: skip
    # None: ServerConfig's defaults (api_server.py, imported only when serving)
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies are answered 413 (default 16 MiB)")  # fmt: skip
    p.add_argument("--max-choices-per-request", type=int, default=None,
                   help="prompts x n in one request; more is a 400 (default 256)")  # fmt: skip
    p.add_argument("--enable-log-requests", action="store_true",
                   help="a log line per request, and uvicorn's access log")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log even with --enable-log-requests (vLLM's flag)")  # fmt: skip
    p.add_argument(
        "--disable-dashboard", action="store_true", help="do not serve the /dashboard page"
    )
    add_engine_args(p)
    p.set_defaults(handler=serve)


def serve_model(args: argparse.Namespace) -> str | None:
    """The model to serve: the positional MODEL or --model (vLLM takes both), not two."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


def core_spec(args: argparse.Namespace) -> EngineCoreSpec:
    """The engine core's recipe from the flags; a bad flag or model path fails here, at once."""
    from .default_model import default_model_dir
    from .engine_core import EngineCoreSpec
    from .loader import resolve_model_dir

    config = EngineConfig(**engine_kwargs(args))
    model_dir = resolve_model_dir(default_model_dir() if args.model is None else args.model)
    return EngineCoreSpec(str(model_dir), args.dtype, args.device, config)


def serve(args: argparse.Namespace) -> None:
    import uvicorn  # the server's dependencies load only for `serve`

    from .api_server import ServerConfig, build_app
    from .async_engine import AsyncLLM
    from .default_model import MODEL_NAME

    args.model = serve_model(args)
    name = args.served_model_name or args.model or MODEL_NAME
    spec = core_spec(args)
    if args.engine_core_address:
        llm = AsyncLLM.connect(spec.model, args.engine_core_address, name)
    else:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        llm = AsyncLLM.spawn(spec, name, args.data_parallel_size)
    try:
        limits = {
            name: value
            for name in ("max_request_body_bytes", "max_choices_per_request")
            if (value := getattr(args, name)) is not None
        }
        config = ServerConfig(
            name, resolve_max_model_len(llm.info, args.max_model_len), args.api_key,
            enable_log_requests=args.enable_log_requests,
            enable_dashboard=not args.disable_dashboard, **limits,
        )  # fmt: skip
        log_kv_capacity(llm.info, len(llm.client.cores), config.max_model_len)
        app = build_app(llm, config)
        url = f"http://{args.host}:{args.port}"
        log.info("serving %s on %s", name, url)
        if config.enable_dashboard:
            key = "?key=KEY" if args.api_key else ""
            log.info("dashboard: %s/dashboard%s", url, key)
        # uvicorn re-raises the SIGTERM it handled once it has shut down; exiting through Python
        # (not by the signal's default action) runs the cleanup below
        signal.signal(signal.SIGTERM, exit_on_sigterm)
        uvicorn.Server(uvicorn_config(app, args)).run()
    finally:
        llm.shutdown()  # stops the engine cores (and their tensor-parallel workers)


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's settings for `serve`: where to listen, and how long a shutdown may wait.

    On SIGTERM uvicorn stops accepting connections and waits for the requests in flight; after
    `--shutdown-timeout` seconds it cancels them, and a cancelled handler closes its streams,
    which aborts its engine requests (api_server.py). Then the process exits.
    """
    import uvicorn

    access_log = args.enable_log_requests and not args.disable_uvicorn_access_log
    # loop/http "auto": uvloop and httptools where installed, asyncio and h11 otherwise
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", access_log=access_log,
        loop="auto", http="auto",
        timeout_graceful_shutdown=max(args.shutdown_timeout, SHUTDOWN_TICK_S),
    )  # fmt: skip


def exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(0)


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def log_kv_capacity(info: CoreInfo, num_cores: int, max_model_len: int) -> None:
    """The KV cache's size in tokens and what it means at the longest request (as vLLM logs)."""
    log.info(
        "KV cache: %d tokens per engine core x %d core(s); maximum concurrency at %d tokens "
        "per request: %.1fx", info.num_kv_slots, num_cores, max_model_len,
        num_cores * info.num_kv_slots / max_model_len,
    )  # fmt: skip


def resolve_max_model_len(info: CoreInfo, requested: int | None) -> int:
    """The model's context, or less when asked; never more than the KV cache can ever hold."""
    limit = min(info.max_position_embeddings, info.num_kv_slots)
    if requested is None:
        return limit
    if not 2 <= requested <= limit:
        raise ValueError(
            f"--max-model-len must be in [2, {limit}] (the model's context and the KV cache), "
            f"got {requested}"
        )
    return requested


def add_engine_core_parser(subparsers) -> None:
    p = subparsers.add_parser("engine-core", help="run one engine core for a remote front end")
    p.add_argument(
        "model", nargs="?", default=None, help="HF directory or hub id (default: SmolLM2)"
    )
    p.add_argument("--address", required=True,
                   help="where to listen: tcp://HOST:PORT (or ipc://PATH)")  # fmt: skip
    add_engine_args(p)
    p.set_defaults(handler=engine_core)


def engine_core(args: argparse.Namespace) -> None:
    from .engine_core import run_engine_core

    spec = core_spec(args)
    log.info("engine core for %s listening on %s", spec.model, args.address)
    run_engine_core(spec, args.address)


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
