"""`poolserve serve`: the server's command line; every flag is also a POOLSERVE_* variable."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from poolserve.config.settings import ServerSettings

# Flags whose presence flips a boolean setting off.
NEGATED_FLAGS = {"async_scheduling": "--no-async-scheduling"}
# Boolean settings with a flag for each value: --NAME and --no-NAME.
PAIRED_FLAGS = frozenset(
    {
        "enable_prefix_caching",
        "auto_truncate",
        "allow_credentials",
        "access_log",
        "allow_slower_precision",
    }
)
LIST_FORMS = "several values, a JSON list or comma-separated"


def build_parser() -> argparse.ArgumentParser:
    """The `poolserve serve` parser (the whole command line, with the jobs, is poolserve/cli.py)."""
    parser = argparse.ArgumentParser(
        prog="poolserve", description="A pooling microservice for language models."
    )
    parser.add_argument("-v", "--version", action="version", version=package_version())
    add_serve_command(parser.add_subparsers(dest="command", required=True))
    return parser


def add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve [MODEL]` and every setting's flag."""
    serve = commands.add_parser(
        "serve",
        help="Start the HTTP server.",
        usage="poolserve serve [MODEL ...] [options]",
        description="Start the HTTP server. Every flag can also be set as POOLSERVE_<FLAG> "
        "(upper case, dashes as underscores); flags win over the environment.",
    )
    serve.add_argument(
        "model_tag",
        nargs="*",
        metavar="MODEL",
        help="The model to serve, as --model takes it (as `vllm serve MODEL` does); several "
        "are served together, each under its own name (--models).",
    )
    add_settings_flags(serve)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every server setting (jobs take the model and its settings as `serve` does)."""
    for name, field in ServerSettings.model_fields.items():
        _add_flag(parser, name, field)


def package_version() -> str:
    """The installed package's version (as vLLM prints its own: the number alone)."""
    try:
        return version("poolserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_flag(serve: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    """One setting's flag: `--name VALUE`, a `--no-...` switch, or a `--name`/`--no-name` pair."""
    env = f"POOLSERVE_{name.upper()}"
    if name in NEGATED_FLAGS:
        serve.add_argument(
            NEGATED_FLAGS[name],
            dest=name,
            action="store_const",
            const=False,
            default=None,
            help=f"Turn off: {field.description} (env {env}=false)",
        )
        return
    flag = "--" + name.replace("_", "-")
    help_text = f"{field.description} (env {env}; default {field.default!r})"
    if name in PAIRED_FLAGS:
        serve.add_argument(
            flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    if _is_list(field):
        help_text = f"{field.description} ({LIST_FORMS}; env {env}; default {_default(field)!r})"
        serve.add_argument(
            flag, dest=name, nargs="+", default=None, metavar="VALUE", help=help_text
        )
        return
    serve.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def _is_list(field: FieldInfo) -> bool:
    """Whether a setting holds several values (its flag then takes several)."""
    annotation = field.annotation
    return any(get_origin(a) is list for a in (annotation, *get_args(annotation)))


def _default(field: FieldInfo) -> object:
    """A field's default, made by its factory if it has one."""
    factory = field.default_factory
    return factory() if factory is not None else field.default  # type: ignore[call-arg]


def parse_settings(argv: Sequence[str] | None = None) -> ServerSettings:
    """Parse flags over the environment into validated settings (exits 2 on bad values)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return settings_from_args(parser, args)


def settings_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerSettings:
    """The settings the parsed flags give, over the environment (exits 2 on bad values)."""
    positional = getattr(args, "model_tag", None) or []
    if positional and args.model is not None and positional[0] != args.model:
        parser.error(
            f"the model is given twice, as {positional[0]!r} and as --model {args.model!r}: "
            "give one of them"
        )
    if positional:
        args.model = positional[0]
    if len(positional) > 1:
        if args.models is not None:
            parser.error("models are given as arguments and as --models: give one of them")
        args.models = positional[1:]
    from poolserve.observability.tracing import TracingUnavailableError, require_tracing

    given = {
        name: getattr(args, name)
        for name in ServerSettings.model_fields
        if getattr(args, name, None) is not None
    }
    try:
        settings = ServerSettings(**given)
        if settings.otlp_traces_endpoint is not None:
            require_tracing()  # a missing package is refused now, before a model loads
    except ValidationError as exc:
        problems = "; ".join(_problem(e["loc"], e["msg"]) for e in exc.errors())
        parser.error(problems)
        raise  # unreachable: parser.error exits
    except TracingUnavailableError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
    return settings


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """One validation error, naming the flag (none for checks across several flags)."""
    message = message.removeprefix("Value error, ")
    if not loc:
        return message
    return f"--{str(loc[0]).replace('_', '-')}: {message}"
