"""The command line's flags: every server setting's flag, in the sections of `--help`, for the
commands it applies to; every flag is also a POOLSERVE_* variable. One error style for all."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from typing import Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from poolserve.config.settings import ServerSettings

# Flags whose presence flips a boolean setting off.
NEGATED_FLAGS = {"async_scheduling": "--no-async-scheduling"}
# Every other boolean setting is a switch with a flag for each value, --NAME and --no-NAME (as
# vLLM's `--trust-request-chat-template` is a switch): derived from the fields' types.
PAIRED_FLAGS = frozenset(
    name
    for name, field in ServerSettings.model_fields.items()
    if field.annotation is bool and name not in NEGATED_FLAGS
)
LIST_FORMS = "several values, a JSON list or comma-separated"

# Which commands take a section's flags. What the engine loads and runs is every command's; what
# a request may send or name is also run-batch's, whose lines are requests answered by the server's
# app; the sockets, processes, auth, CORS, access log and traces of the HTTP server are `serve`'s.
EVERY_COMMAND = frozenset({"serve", "run-batch", "embed"})
ANSWERS_REQUESTS = frozenset({"serve", "run-batch"})
SERVE_ONLY = frozenset({"serve"})


@dataclass(frozen=True)
class Group:
    """One section of --help: its settings in order, and the commands whose flags they are."""

    title: str
    settings: tuple[str, ...]
    commands: frozenset[str] = EVERY_COMMAND


# Each setting's section, declared once (tests/config/test_help.py: every setting in exactly one).
GROUPS: tuple[Group, ...] = (
    Group("model", ("model", "revision", "served_model_name", "max_model_len", "hf_overrides")),
    Group("several models", ("models", "models_config", "default_model"), ANSWERS_REQUESTS),
    Group("device and precision", ("device", "dtype", "quantization", "allow_slower_precision")),
    Group(
        "scheduler",
        (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_num_queued_requests",
            "max_num_queued_tokens",
            "long_prefill_token_threshold",
            "async_scheduling",
        ),
    ),
    Group("KV cache", ("num_kv_blocks", "block_size", "enable_prefix_caching")),
    Group(
        "pooler and outputs",
        (
            "pooler_config",
            "default_prompt_name",
            "matryoshka_dimensions",
            "score_template",
        ),
    ),
    Group("LoRA adapters", ("enable_lora", "lora_modules", "max_loras", "max_lora_rank")),
    Group("input bounds", ("max_input_chars", "max_request_chars", "max_tokenizing_chars")),
    Group(
        "requests",
        ("auto_truncate", "max_client_batch_size", "payload_limit", "trust_request_chat_template"),
        ANSWERS_REQUESTS,
    ),
    Group(
        "images",
        (
            "allowed_media_domains",
            "allow_private_media_addresses",
            "media_fetch_timeout",
            "max_image_bytes",
            "max_image_pixels",
            "max_media_redirects",
            "max_images_per_request",
        ),
        ANSWERS_REQUESTS,
    ),
    Group(
        "HTTP server",
        (
            "host",
            "port",
            "root_path",
            "body_timeout",
            "vertex_predict_route",
            "vertex_health_route",
        ),
        SERVE_ONLY,
    ),
    Group("gRPC server", ("grpc_port",), SERVE_ONLY),
    Group(
        "Batch API",
        ("batch_dir", "max_batch_file_bytes", "max_batch_storage_bytes", "max_batch_requests"),
        SERVE_ONLY,
    ),
    Group(
        "processes and shutdown",
        (
            "api_server_count",
            "core_malloc",
            "engine_core_timeout",
            "shutdown_timeout",
            "drain_delay",
        ),
        SERVE_ONLY,
    ),
    Group("security", ("api_key", "api_keys_file", "ssl_keyfile", "ssl_certfile"), SERVE_ONLY),
    Group(
        "CORS",
        ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"),
        SERVE_ONLY,
    ),
    Group("logging", ("log_level", "log_format")),
    Group("access log and tracing", ("access_log", "otlp_traces_endpoint"), SERVE_ONLY),
)


def settings_of(command: str) -> tuple[str, ...]:
    """The settings whose flags `command` takes, in --help's order."""
    return tuple(name for g in GROUPS if command in g.commands for name in g.settings)


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
    add_settings_flags(serve, "serve")


def add_settings_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of the settings `command` takes, one --help section per group."""
    for group in GROUPS:
        if command in group.commands:
            section = parser.add_argument_group(group.title)
            for name in group.settings:
                _add_flag(section, name, ServerSettings.model_fields[name])


def package_version() -> str:
    """The installed package's version (as vLLM prints its own: the number alone)."""
    try:
        return version("poolserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_flag(section: argparse._ActionsContainer, name: str, field: FieldInfo) -> None:
    """One setting's flag: `--name VALUE`, a `--no-...` switch, or a `--name`/`--no-name` pair."""
    env = f"POOLSERVE_{name.upper()}"
    if name in NEGATED_FLAGS:
        section.add_argument(
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
        section.add_argument(
            flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    if _is_list(field):
        help_text = f"{field.description} ({LIST_FORMS}; env {env}; default {_default(field)!r})"
        section.add_argument(
            flag, dest=name, nargs="+", default=None, metavar="VALUE", help=help_text
        )
        return
    choices = _choices(field)
    metavar = None if choices else name.upper()  # argparse then shows {a,b,c}
    section.add_argument(
        flag, dest=name, default=None, choices=choices, metavar=metavar, help=help_text
    )


def _choices(field: FieldInfo) -> list[str] | None:
    """The values a Literal or Enum setting takes (None allowed beside them stays the default)."""
    for kind in (field.annotation, *get_args(field.annotation)):
        if get_origin(kind) is Literal:
            return [str(value) for value in get_args(kind)]
        if isinstance(kind, type) and issubclass(kind, Enum):
            return [str(member.value) for member in kind]
    return None


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
    args = parse_command_line(parser, argv)
    return settings_from_args(parser, args)


def parse_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown flag is refused by its subcommand (exit 2).

    argparse lets the top-level parser refuse what a subcommand did not take, with the top-level
    usage; the subcommand's own usage and its closest flag say what to type instead.
    """
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = _subcommand(parser, args.command)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_hints(command, unknown)}")
    return args


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand `name`."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = commands.choices[name]
    return command


def _hints(command: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What each unknown flag may have meant: the commands that take it, else this command's
    closest flag."""
    known = [flag for action in command._actions for flag in action.option_strings]
    hints = []
    for given in (word.split("=", 1)[0] for word in unknown if word.startswith("-")):
        close = difflib.get_close_matches(given, known, n=1)
        elsewhere = [c for c in sorted(EVERY_COMMAND) if given in _flags_of(c)]
        if elsewhere:  # a setting this command has no use for: a near name would mislead
            hints.append(f"{given} is a flag of {', '.join(f'poolserve {c}' for c in elsewhere)}")
        elif close:
            hints.append(f"did you mean {close[0]}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _flags_of(command: str) -> set[str]:
    """The setting flags `command` takes (as `_add_flag` spells them)."""
    flags = {"--" + name.replace("_", "-") for name in settings_of(command)}
    flags |= {f"--no-{flag[2:]}" for flag in flags if flag[2:].replace("-", "_") in PAIRED_FLAGS}
    return flags | {NEGATED_FLAGS[n] for n in settings_of(command) if n in NEGATED_FLAGS}


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
