"""``slotserve serve [flags]`` (also ``python -m app serve``). Every flag mirrors a ``Settings``
field and its ``SLOTSERVE_<FIELD>`` environment variable; a flag wins over the environment."""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError
from pydantic_core import PydanticUndefined

from app.config import Settings
from app.version import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve", description="A continuous-batching LLM inference server."
    )
    parser.add_argument("--version", action="version", version=f"slotserve {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP: a mock (default; with --profile, a GPU stand-in) or a "
        "real one (--model smollm2 | hf:PATH)",
        description="Serve a model over HTTP (native, OpenAI and Anthropic APIs): a mock model "
        "(the default; --profile makes it keep a GPU's time) or a real one on the CPU (--model "
        "smollm2 | hf:PATH). Each flag can also be set as SLOTSERVE_<FLAG> (e.g. "
        "SLOTSERVE_NUM_SLOTS=64).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, field in Settings.model_fields.items():
        _add_flag(serve, name, field.annotation, field.default, field.description or "")
    commands.add_parser("bench", help="load-test a server (slotserve bench --help)", add_help=False)
    commands.add_parser(
        "simulate",
        help="replay a workload in virtual time (slotserve simulate --help)",
        add_help=False,
    )
    return parser


# Other spellings of a Settings field's flag (vLLM's names).
FLAG_ALIASES = {"model_config_file": ["--model-config"], "num_slots": ["--max-num-seqs"]}


def _add_flag(
    parser: argparse.ArgumentParser, name: str, annotation: Any, default: Any, help: str
) -> None:
    flags = ["--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, [])]
    env = f"SLOTSERVE_{name.upper()}"
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    choices = _literal_choices(annotation)
    if name == "lora_modules":  # vLLM's form: --lora-modules a=PATH b=PATH (repeatable too)
        kwargs |= {"action": "extend", "nargs": "+"}
    elif typing.get_origin(annotation) is list:
        kwargs["action"] = "append"
    elif choices:
        kwargs["choices"] = choices
    elif annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif annotation in (int, float):
        kwargs["type"] = annotation
    elif annotation == Path | None:
        kwargs["type"] = Path
    shown = "(unset)" if default in (None, PydanticUndefined) else default
    parser.add_argument(*flags, help=f"{help} [env {env}; default {shown}]", **kwargs)


def _literal_choices(annotation: Any) -> list[str] | None:
    args = typing.get_args(annotation)
    if type(None) in args and len(args) == 2:  # an optional choice: Literal[...] | None
        annotation = next(arg for arg in args if arg is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"]:  # its own parser: app/bench/cli.py
        from app.bench.cli import main as bench

        raise SystemExit(bench(args[1:]))
    if args[:1] == ["simulate"]:  # its own parser: app/simulate/cli.py
        from app.simulate.cli import main as simulate

        raise SystemExit(simulate(args[1:]))
    command, settings = parse(args)
    if command == "serve":
        serve(settings)


def parse(argv: Sequence[str] | None = None) -> tuple[str, Settings]:
    """The command and its settings (flags over ``SLOTSERVE_*`` variables over defaults). A bad
    value exits with status 2 and a message naming the flag and its variable, as argparse does
    for its own errors."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    try:
        return command, Settings(**args)
    except ValidationError as err:
        parser.error("; ".join(_describe(error) for error in err.errors()))


def _describe(error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error.get("loc"):
        return message  # about several fields (e.g. the same API key in a flag and the file)
    name = str(error["loc"][0])
    flag = "--" + name.replace("_", "-")
    got = "" if name.startswith("api_key") else f", got {error.get('input')!r}"  # keys unseen
    return f"{flag} (SLOTSERVE_{name.upper()}): {message}{got}"


def check_real_model(settings: Settings) -> None:
    """Exit with one line (status 2) if a real model cannot load: a missing package (with the
    command that installs it), a bad path, an unsupported architecture."""
    from app.models.hf import ModelLoadError, check_spec

    if settings.enable_lora:
        _exit("--enable-lora: LoRA adapters are simulated for the mocks only; a real model has "
              "no LoRA weights path")  # fmt: skip
    try:
        check_spec(settings.model)
    except ModelLoadError as exc:
        _exit(str(exc))
    if settings.enable_prefix_caching:
        _exit("--enable-prefix-caching: the real model's runner has no prefix cache (only the "
              "mocks do)")  # fmt: skip


def _exit(message: str) -> NoReturn:
    """One line on stderr, then exit status 2 (as argparse's errors)."""
    print(f"slotserve: error: {message}", file=sys.stderr)
    raise SystemExit(2) from None


def serve(settings: Settings) -> None:
    from app.api.app import create_app
    from app.engine.errors import UnsupportedFeatureError
    from app.kv_events.publisher import KVEventsError
    from app.lora import LoRAError
    from app.models.hf import is_real_model
    from app.models.hf.errors import ModelLoadError
    from app.server import run
    from app.serving.loading import named

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if is_real_model(settings.model):
        check_real_model(settings)
        settings = named(settings)
    names = ", ".join(settings.api_keys().names) or "none (no authentication)"
    logging.getLogger("slotserve").info(
        "serving %s on %s:%d with %d slots (api keys: %s)",
        settings.model_name, settings.host, settings.port, settings.num_slots, names,
    )  # fmt: skip
    try:
        app = create_app(settings)
    # e.g. prefix caching on a model without it, a KV-event port in use, --tokenizer's folder
    except (UnsupportedFeatureError, KVEventsError, LoRAError, ModelLoadError) as err:
        raise SystemExit(f"slotserve: error: {err}") from None
    run(app, settings.host, settings.port, settings.log_level)


if __name__ == "__main__":
    main()
