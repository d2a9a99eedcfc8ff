"""`poolserve`: the command line. `serve` runs the server; the jobs run a model over files.

Each command adds its own subparser and sets `run(args) -> exit code` on it; the model and its
settings are flags of every command, as `poolserve serve` takes them, each command taking the
sections that apply to it (`poolserve.config.flags.GROUPS`, `add_settings_flags`,
`settings_from_args`). Usage errors exit 2, runtime errors 1, both as `poolserve CMD: error: ...`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from poolserve.config.flags import (
    add_serve_command,
    package_version,
    parse_command_line,
    settings_from_args,
)
from poolserve.config.preflight import preflight
from poolserve.config.settings import ServerSettings
from poolserve.jobs.corpus.command import add_embed_command
from poolserve.jobs.run_batch import add_run_batch
from poolserve.memory import core_malloc_problem, fix_mmap_threshold
from poolserve.observability.logs import OPERATOR_ERRORS, configure_logging, report_start_failure
from poolserve.types.errors import command_error

if TYPE_CHECKING:  # argparse's class takes a type argument only for type checkers
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]
    from poolserve.http.edge.server import Beside


def _add_serve(commands: Commands) -> None:
    """`serve`: the HTTP server (it ends the process itself)."""
    add_serve_command(commands)
    parser = commands.choices["serve"]
    parser.set_defaults(run=lambda args: serve(settings_from_args(parser, args)))


# command -> what adds its subparser; jobs import their heavy modules only when they run
COMMANDS: tuple[Callable[[Commands], None], ...] = (_add_serve, add_run_batch, add_embed_command)


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser."""
    parser = argparse.ArgumentParser(
        prog="poolserve", description="A pooling microservice for language models."
    )
    parser.add_argument("-v", "--version", action="version", version=package_version())
    commands = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return parser


def serve(settings: ServerSettings) -> None:
    """Serve with these settings until SIGTERM/SIGINT, drain, then end the process."""
    configure_logging(settings.log_level, settings.log_format)
    # Before torch loads and threads start: allocations after this follow the fixed threshold.
    fix_mmap_threshold()
    # Idle OpenMP threads sleep instead of spinning, so the forward's thread team does not take
    # the cores the HTTP work needs between steps (docs/benchmarks.md, "Front end: per-request
    # cost": 2-3x the requests on 2 cores); an operator's value wins. Children inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from poolserve.supervisor import ListenError, bind_port, supervise

    try:
        # the port first (one plain bind, closed again: the server's own comes later), then the
        # models and files: all before any process starts or any model loads
        bind_port(settings.host, settings.port, 1)[0].close()
        if settings.grpc_port:  # --grpc-port too (0: the kernel picks one when it starts)
            _check_grpc_port(settings.host, settings.grpc_port)
        preflight(settings)
        problem = core_malloc_problem(settings.core_malloc, settings.api_server_count)
        if problem is not None:
            raise ValueError(problem)
    except ListenError as exc:
        _exit(command_error("serve", str(exc.strerror)))
    except OPERATOR_ERRORS as exc:
        report_start_failure("serve", exc)
        _exit(1)
    if settings.api_server_count > 0:
        supervise(settings.model_dump_json())  # this process becomes the supervisor
    try:
        sockets = bind_port(settings.host, settings.port, 1)
        from poolserve.http.edge.server import run_server  # imported late: for --help

        code = 0 if run_server(settings, sockets=sockets, beside=_beside(settings)) else 1
    except ListenError as exc:
        code = command_error("serve", str(exc.strerror))
    _exit(code)


def _check_grpc_port(host: str, port: int) -> None:
    """ListenError, naming the flag, when anything listens on the gRPC port."""
    from poolserve.supervisor import ListenError, bind_port

    try:
        bind_port(host, port, 1)[0].close()
    except ListenError as exc:
        why = str(exc.strerror).replace("pick --port", "pick --grpc-port")
        raise ListenError(exc.errno, f"--grpc-port: {why}") from exc


def _beside(settings: ServerSettings) -> tuple[Beside, ...]:
    """The gRPC server when --grpc-port asks for it (its code loads only then)."""
    if settings.grpc_port is None:
        return ()
    from poolserve.grpc.server import beside_http

    return beside_http(settings)


def _exit(code: int) -> NoReturn:
    """End the process now. Drained and closed: skip the interpreter's teardown of torch and
    friends, which takes seconds on a busy machine and would push the exit past
    --shutdown-timeout."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command named on the command line; exit with its code."""
    parser = build_parser()
    args = parse_command_line(parser, argv)
    sys.exit(args.run(args))


if __name__ == "__main__":
    main()
