"""Flags shared by `mini-vllm`'s subcommands: the engine's, derived from `EngineConfig` (vLLM's
`EngineArgs`, engine/arg_utils.py), and the sampling flags of the offline ones.

Every `EngineConfig` field is a flag of its own (`max_num_seqs` -> `--max-num-seqs`), derived
from the dataclass, so a knob added to the engine is a flag here without touching this file
(phase 7's `--tensor-parallel-size`, alias `-tp`, `--load-format`, `--enforce-eager`, and the KV
cache's `--gpu-memory-utilization`, `--kv-cache-memory-bytes`, `--num-kv-blocks` among them; vLLM's
`--num-gpu-blocks-override` is another name for the last). A field that may be None (the engine
chooses) is a flag that may be left out. The engine itself is imported only by the functions
that build one (see cli.py: torch must not load before `main` has set OpenMP's wait policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import typing

from .config import VLLM_IGNORED, VLLM_UNSUPPORTED, EngineConfig

if typing.TYPE_CHECKING:
    from .engine import LLM
    from .sampling_params import SamplingParams

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no TLS
DEFAULT_PORT = 8000
# vLLM's other names for a flag, where it has them
FLAG_ALIASES = {"tensor_parallel_size": ("-tp",), "num_kv_blocks": ("--num-gpu-blocks-override",)}
# what a flag left out means, where "the device's" would not say it
DEVICE_DEFAULT = "the device's"
NONE_MEANS = {"max_model_len": "the model's context, or the KV cache's size if smaller"}
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


def add_engine_args(parser: argparse.ArgumentParser, engine_seed: bool = False) -> None:
    """`engine_seed`: a `--seed` for the engine's random state (vLLM's; serve, engine-core),
    where the offline commands' `--seed` seeds each request instead."""
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    if engine_seed:
        parser.add_argument("--seed", type=int, default=None,
                            help="seeds the engine's random state, which requests without a "
                                 "seed of their own draw from (vLLM's flag)")  # fmt: skip
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
        field_help = f"EngineConfig.{f.name}"
        if f.default is None:  # the engine chooses (kv_cache_config.py, EngineConfig.for_device)
            field_help += f" (default: {NONE_MEANS.get(f.name, DEVICE_DEFAULT)})"
        if bool in (hints[f.name], *typing.get_args(hints[f.name])):  # bool, or bool | None
            # a switch, never a value: type=bool would read "--async-scheduling false" as True
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
    add_vllm_engine_args(parser)


VLLM_PREFIX = "vllm_"  # their destinations: engine_kwargs hands them to engine_config by name


def add_vllm_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags that mean nothing here (config.py's tables), so that a `vllm serve`
    command line runs: one that changes nothing whatever its value (`--trust-remote-code`) is
    accepted; an unsupported one only at the value that asks for nothing, and refused with the
    reason at any other (the engine's check, `engine_config`). A subcommand's own flag of the
    same name (serve's `--data-parallel-size`) wins."""
    for name, (neutral, why) in {**VLLM_UNSUPPORTED, **VLLM_IGNORED}.items():
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        accepted = " or ".join(map(repr, neutral if isinstance(neutral, tuple) else (neutral,)))
        meaning = f"vLLM's; changes nothing here: {why}" if name in VLLM_IGNORED else (
            f"vLLM's; only {accepted} is accepted: {why}")  # fmt: skip
        if isinstance(neutral, tuple):  # several values ask for nothing: the first is the default
            neutral = neutral[0]
        if isinstance(neutral, bool):
            parser.add_argument(flag, dest=VLLM_PREFIX + name, action="store_true", help=meaning)
        else:
            kind = str if neutral is None else type(neutral)
            parser.add_argument(flag, dest=VLLM_PREFIX + name, type=kind, default=neutral,
                                metavar=name.upper(), help=meaning)  # fmt: skip


def value_type(hint) -> type:
    """`int | None` -> int: a flag left out keeps the default None (the engine chooses)."""
    types = [t for t in typing.get_args(hint) if t is not type(None)]
    return types[0] if types else hint


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def vllm_kwargs(args: argparse.Namespace) -> dict:
    """vLLM's flags (above) by their names, for `engine_config` (or `LLM`) to refuse any that
    asks for something this engine cannot do."""
    return {dest.removeprefix(VLLM_PREFIX): value for dest, value in vars(args).items()
            if dest.startswith(VLLM_PREFIX)}  # fmt: skip


def load_llm(args: argparse.Namespace) -> LLM:
    from .default_model import MODEL_NAME
    from .engine import LLM

    log.info("loading %s", args.model or f"{MODEL_NAME} (its first use converts it, once)")
    return LLM(
        args.model, dtype=args.dtype, device=args.device, **engine_kwargs(args), **vllm_kwargs(args)
    )


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens at most")
    parser.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p")
    parser.add_argument("--top-k", type=int, default=None, help="default: no top-k filter")
    parser.add_argument("--seed", type=int, default=None, help="default: unseeded")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from .sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip
