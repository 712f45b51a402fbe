"""`mini-vllm serve` and `mini-vllm engine-core`: the OpenAI-compatible server, and an engine core
on its own for a front end elsewhere (vLLM's entrypoints/cli/serve.py).

- `mini-vllm serve [MODEL]` (or `--model MODEL`): a front end process and
  `--data-parallel-size` engine core processes it spawns, or, with `--engine-core-address`,
  engine cores started elsewhere; on SIGTERM or Ctrl-C it stops accepting connections, lets
  in-flight requests run for at most `--shutdown-timeout` seconds (vLLM's flag; 0, the default,
  aborts them at once), then exits. It logs the KV cache's capacity in tokens and the maximum
  concurrency at the longest request (`--max-model-len`, an engine flag: the engine core
  resolves and enforces it, and the server refuses longer requests with a 400), as vLLM does;
- `mini-vllm engine-core [MODEL] --address tcp://HOST:PORT`: one engine core, which serves
  whichever front end said hello last.

The server's modules (uvicorn, FastAPI, the engine) are imported by the handlers, not here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import typing
from pathlib import Path

from .arg_utils import DEFAULT_HOST, DEFAULT_PORT, add_engine_args, engine_kwargs, vllm_kwargs
from .config import (
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    ServerConfig,
    check_root_path,
    engine_config,
)

if typing.TYPE_CHECKING:
    from .core_messages import CoreInfo
    from .engine_core import EngineCoreSpec

# uvicorn's wait with a timeout of exactly 0 is cancelled before it can see that nothing is
# running, and logs an error even for an idle server; a tick is "at once" for any request.
SHUTDOWN_TICK_S = 0.01
log = logging.getLogger(__name__)


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    p.add_argument("--host", default=DEFAULT_HOST, help="the address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' (default: $VLLM_API_KEY, "
                        "if set)")  # fmt: skip
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name clients use as model; more names are accepted too, the first "
                        "is the one responses carry (vLLM's flag)")  # fmt: skip
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    p.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates to verify clients' certificates with")  # fmt: skip
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own, else a new "
                        "one (vLLM's flag)")  # fmt: skip
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json (vLLM's flag)")  # fmt: skip
    # vLLM's flags that ask for what this server does anyway, accepted for its command lines
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag; requests are not logged unless "
                        "--enable-log-requests")  # fmt: skip
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="vLLM's; changes nothing here: a request's log line holds no prompt",
    )
    p.add_argument("--response-role", choices=["assistant"], default="assistant",
                   help="vLLM's; a reply's role is always assistant here")  # fmt: skip
    p.add_argument("--api-server-count", type=int, choices=[1], default=1,
                   help="vLLM's; one front end process (its engine cores are "
                        "--data-parallel-size)")  # fmt: skip
    p.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string"],
        default="auto",
        help="vLLM's; a message's text parts reach the template as one string",
    )
    for what in ("origins", "methods", "headers"):
        p.add_argument(f"--allowed-{what}", type=json_list, default=["*"],
                       help=f"CORS, a JSON list: the {what} allowed to a browser page served "
                            "from another origin (vLLM's flag)")  # fmt: skip
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: a browser may send cookies and credentials (vLLM's flag)",
    )
    p.add_argument("--shutdown-timeout", type=seconds, default=0.0,
                   help="seconds in-flight requests may run after SIGTERM before they are "
                   "aborted (0: at once)")  # fmt: skip
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine cores behind this front end, each on its own GPU(s)")  # fmt: skip
    p.add_argument("--engine-core-address", nargs="+", default=None, metavar="ADDRESS",
                   help="connect to engine cores started with `mini-vllm engine-core` instead of "
                        "spawning them (tcp://HOST:PORT or ipc://PATH)")  # fmt: skip
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies are answered 413 (default: 16 MiB)")  # fmt: skip
    p.add_argument("--max-choices-per-request", type=int, default=DEFAULT_MAX_CHOICES_PER_REQUEST,
                   help="prompts x n in one request; more is a 400 (default 256)")  # fmt: skip
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                   help="the newest /v1/responses kept in memory for GET and "
                        "previous_response_id (default 1000; 0: none)")  # fmt: skip
    p.add_argument("--enable-log-requests", action="store_true",
                   help="a log line per request, and uvicorn's access log")  # fmt: skip
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage reports the prompt tokens found in the prefix cache "
                        "(prompt_tokens_details.cached_tokens; vLLM's flag)")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                   help="chats carry a thinking model's <think> text as reasoning_content "
                        "(vLLM's flag)")  # fmt: skip
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load answers the generation requests in progress, for a load "
                        "balancer (vLLM's flag)")  # fmt: skip
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed chunk carries usage, whatever the request's "
                        "stream_options (vLLM's flag)")  # fmt: skip
    p.add_argument("--root-path", type=root_path, default="",
                   help="the path prefix of a proxy in front (/llm: /llm/v1/... and /v1/... "
                        "both served; vLLM's flag)")  # fmt: skip
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template for every chat, a file or the template itself, "
                        "instead of the checkpoint's (vLLM's flag)")  # fmt: skip
    p.add_argument("--generation-config", default="auto",
                   help="'auto': what a request leaves unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens) is sampled as the checkpoint's "
                        "generation_config.json recommends; 'vllm': the API's defaults; or a "
                        "directory whose generation_config.json to read (vLLM's flag)")  # fmt: skip
    p.add_argument("--override-generation-config", type=json_object, default=None,
                   help='defaults over the generation config\'s, as JSON: \'{"temperature": '
                        '0.5}\' (vLLM\'s flag)')  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag; changes nothing here: a chat with tools always has its "
                        "Hermes-format calls parsed (tool_choice auto)")  # fmt: skip
    p.add_argument("--tool-call-parser", choices=["hermes", "qwen3_coder", "qwen3_xml"],
                   default="hermes",
                   help="vLLM's flag; every name reads the same <tool_call> blocks, JSON inside "
                        "(Hermes', Qwen3's) or XML (Qwen3.5's, Qwen3-Coder's)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (vLLM's flag)")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log even with --enable-log-requests (vLLM's flag)")  # fmt: skip
    p.add_argument(
        "--disable-dashboard", action="store_true", help="do not serve the /dashboard page"
    )
    add_engine_args(p, engine_seed=True)
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
    from .kv_cache_config import model_len
    from .loader import read_model_config, resolve_model_dir
    from .sampling_params import SEED_LIMIT

    config = engine_config("EngineConfig", {**engine_kwargs(args), **vllm_kwargs(args)}, ())
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    model_dir = resolve_model_dir(default_model_dir() if args.model is None else args.model)
    model_len(read_model_config(model_dir), config)  # a --max-model-len past the context fails
    return EngineCoreSpec(str(model_dir), args.dtype, args.device, config, seed=args.seed)


def serve(args: argparse.Namespace) -> None:
    import uvicorn  # the server's dependencies load only for `serve`

    from .api_server import build_app
    from .async_engine import AsyncLLM
    from .default_model import MODEL_NAME
    from .sampling_params import generation_defaults

    # Ctrl-C and SIGTERM stop the server quietly, with exit code 0 (a normal shutdown): uvicorn
    # handles them while it runs, then re-raises the one it got; exiting through Python (not by
    # the signal's default action, nor as a KeyboardInterrupt's traceback) runs the cleanup below
    signal.signal(signal.SIGINT, exit_on_signal)
    signal.signal(signal.SIGTERM, exit_on_signal)
    args.model = serve_model(args)
    args.api_key = api_key(args.api_key)
    args.chat_template = read_chat_template(args.chat_template)
    name, *aliases = args.served_model_name or [args.model or MODEL_NAME]
    spec = core_spec(args)
    sampling_defaults = generation_defaults(
        spec.model, args.generation_config, args.override_generation_config
    )  # before a spawn
    if sampling_defaults:
        log.info("requests sample as the model's generation config recommends, where they do "
                 "not say (--generation-config vllm: the API's defaults): %s",
                 sampling_defaults)  # fmt: skip
    if args.engine_core_address:
        llm = AsyncLLM.connect(spec.model, args.engine_core_address, name)
    else:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        llm = AsyncLLM.spawn(spec, name, args.data_parallel_size)
    try:
        config = ServerConfig(
            name, llm.info.max_model_len, args.api_key,
            max_request_body_bytes=args.max_request_body_bytes,
            max_choices_per_request=args.max_choices_per_request,
            max_stored_responses=args.max_stored_responses,
            enable_log_requests=args.enable_log_requests,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_dashboard=not args.disable_dashboard, model_root=args.model,
            reasoning_parser=args.reasoning_parser,
            enable_server_load_tracking=args.enable_server_load_tracking,
            enable_force_include_usage=args.enable_force_include_usage,
            root_path=args.root_path, chat_template=args.chat_template,
            sampling_defaults=sampling_defaults,
            allowed_origins=tuple(args.allowed_origins),
            allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers),
            allow_credentials=args.allow_credentials,
            model_aliases=tuple(aliases), disable_fastapi_docs=args.disable_fastapi_docs,
            enable_request_id_headers=args.enable_request_id_headers,
        )  # fmt: skip
        log_kv_capacity(llm.info, len(llm.client.cores), config.max_model_len)
        app = build_app(llm, config)
        url = f"http://{args.host}:{args.port}"
        log.info("serving %s on %s", name, url)
        if config.enable_dashboard:
            key = "?key=KEY" if args.api_key else ""
            log.info("dashboard: %s/dashboard%s", url, key)
        uvicorn.Server(uvicorn_config(app, args)).run()
    finally:
        llm.shutdown()  # stops the engine cores (and their tensor-parallel workers)


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's settings for `serve`: where to listen, and how long a shutdown may wait.

    On SIGTERM uvicorn stops accepting connections and waits for the requests in flight; after
    `--shutdown-timeout` seconds it cancels them, and a cancelled handler closes its streams,
    which aborts its engine requests (serving_engine.py). Then the process exits.
    """
    import uvicorn

    access_log = args.enable_log_requests and not args.disable_uvicorn_access_log
    # loop/http "auto": uvloop and httptools where installed, asyncio and h11 otherwise
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=access_log,
        loop="auto", http="auto",
        timeout_graceful_shutdown=max(args.shutdown_timeout, SHUTDOWN_TICK_S),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
    )  # fmt: skip


def json_object(text: str) -> dict:
    """A flag's JSON object (vLLM's spelling: --override-generation-config '{"top_k": 20}')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {text!r}")
    return value


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's spelling: --allowed-origins '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, got {text!r}")
    return value


def api_key(flag: str | None) -> str | None:
    """--api-key, or else $VLLM_API_KEY (vLLM's rule: a key in the environment stays out of
    `ps`); None: no key asked."""
    return flag or os.environ.get("VLLM_API_KEY") or None


def read_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (vLLM's rule: text with a brace
    or a line break is a template; anything else names a file, which must exist), compiled here
    so a broken one fails at start-up, not at the first chat."""
    from .tokenizer import compile_chat_template

    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(c in given for c in "{}\n"):
        template = given
    else:
        raise FileNotFoundError(f"--chat-template {given!r}: no such file (nor a template)")
    try:
        compile_chat_template(template)
    except Exception as e:  # jinja2's TemplateSyntaxError, with its line
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return template


def exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(0)


def root_path(text: str) -> str:
    """argparse type: /prefix, or nothing (checked at once, not after the model has loaded)."""
    try:
        check_root_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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


def add_engine_core_parser(subparsers) -> None:
    p = subparsers.add_parser("engine-core", help="run one engine core for a remote front end")
    p.add_argument(
        "model", nargs="?", default=None, help="HF directory or hub id (default: SmolLM2)"
    )
    p.add_argument("--address", required=True,
                   help="where to listen: tcp://HOST:PORT (or ipc://PATH)")  # fmt: skip
    add_engine_args(p, engine_seed=True)
    p.set_defaults(handler=engine_core)


def engine_core(args: argparse.Namespace) -> None:
    from .engine_core import run_engine_core

    spec = core_spec(args)
    log.info("engine core for %s listening on %s", spec.model, args.address)
    run_engine_core(spec, args.address)
