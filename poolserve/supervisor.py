"""`--api-server-count N`: one engine-core process and N front-end processes on one port.

This process is the supervisor: it binds the port (the front ends inherit the socket and the
kernel spreads connections over them), starts the engine core and the front ends, and watches
them. SIGTERM (or SIGINT) drains: every front end drains as a single server does, then the
core finishes what is left and stops; exit 0. SIGHUP goes on to every front end, which re-reads
the API keys file. Any child that exits on its own takes the server down, loudly and non-zero:
a lost engine core first turns every front end's answers into 503 (its connection closes), a
lost front end stops the rest; a model that cannot start is said in
one line, by the process that hit it, and stops everything at once (exit 1). Restarting is the
orchestrator's job.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from poolserve.memory import core_environment, fix_mmap_threshold
from poolserve.observability.logs import LogFormat, configure_logging, report_start_failure
from poolserve.types.errors import ModelStartError
from poolserve.types.process import CORE_LOST_SIGNAL, MULTIPROCESS_DIR, CoreMalloc

if TYPE_CHECKING:  # the children read the settings; the supervisor itself needs none of pydantic
    from poolserve.config.models_file import ServedModels
    from poolserve.config.settings import ServerSettings
    from poolserve.types.observer import EngineObserver

logger = logging.getLogger(__name__)

# The settings document the children validate, in the server's working folder.
SETTINGS_FILE = "settings.json"
# After the engine core is lost, front ends keep answering 503 this long before they stop.
LOST_CORE_GRACE_S = 1.0
# How often the supervisor looks at its children.
WATCH_INTERVAL_S = 0.1
# Tells a child which process supervises it.
SUPERVISOR_PID = "POOLSERVE_SUPERVISOR_PID"
# Linux prctl option: the signal a child gets when its parent dies.
PR_SET_PDEATHSIG = 1
# A front end's exit codes after a drain that count as clean: drained (0), or ended by the
# supervisor's own SIGTERM before it could serve (still starting: no handler set yet).
STOPPED_CLEANLY = frozenset({0, -signal.SIGTERM})
# What a child gets beyond --shutdown-timeout to exit after SIGTERM before it is killed.
EXIT_GRACE_S = 5.0
# A child's exit code when the server could not start (it said why in one line): the others,
# which have served nothing, are killed at once and the server exits 1.
START_FAILED_EXIT = 3


@dataclass(frozen=True)
class Plan:
    """What the supervisor itself reads of the settings (plain JSON: no pydantic here)."""

    host: str
    port: int
    api_server_count: int
    shutdown_timeout: float
    log_level: str
    log_format: LogFormat
    core_malloc: CoreMalloc

    @classmethod
    def of(cls, settings: dict[str, Any]) -> Plan:
        """The plan of a settings document (the children validate the whole of it)."""
        return cls(**{f.name: settings[f.name] for f in fields(cls)})


def supervise(settings_json: str) -> NoReturn:
    """Become the supervisor of `--api-server-count N`: this process is replaced by a fresh
    interpreter that loads none of the settings' pydantic models, which the CLI has parsed."""
    workdir = Path(tempfile.mkdtemp(prefix="poolserve-"))
    settings_file = workdir / SETTINGS_FILE
    settings_file.write_text(settings_json)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(
        sys.executable, [sys.executable, "-m", "poolserve.supervisor", "supervise", str(workdir)]
    )


def run_processes(plan: Plan, workdir: Path) -> int:
    """Serve with an engine-core process and N front ends until drained; the exit code."""
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    settings_file = workdir / SETTINGS_FILE
    # each child's prometheus-client reads it when first imported
    env = {**os.environ, MULTIPROCESS_DIR: str(metrics_dir), SUPERVISOR_PID: str(os.getpid())}
    # model i's engine core listens on socket_path(address, i)
    address = str(workdir / "cores")
    os.mkdir(address)
    listeners = bind_port(plan.host, plan.port, plan.api_server_count)
    supervisor = _Supervisor(plan)
    # the children start ignoring SIGHUP (inherited): the core for good, a front end until its
    # app has started and handles it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        core_env, malloc = core_environment(env, plan.core_malloc)
        logger.info("engine core's malloc: %s", malloc)
        supervisor.core = _spawn(["core", str(settings_file), address], core_env)
        supervisor.front_ends = [
            _spawn(["api", str(settings_file), address, str(listener.fileno())], env, listener)
            for listener in listeners
        ]
        for listener in listeners:
            listener.close()  # the front ends hold them now
        signal.signal(signal.SIGHUP, supervisor.on_hangup)
        return supervisor.watch()
    finally:
        supervisor.kill_all()


def _spawn(
    args: list[str], env: dict[str, str], listener: socket.socket | None = None
) -> subprocess.Popen[bytes]:
    """A child in its own process group: a terminal's Ctrl-C reaches the supervisor only,
    which turns it into one orderly drain."""
    return subprocess.Popen(
        [sys.executable, "-m", "poolserve.supervisor", *args],
        env=env,
        pass_fds=() if listener is None else (listener.fileno(),),
        process_group=0,
    )


class _Supervisor:
    """Watches the children; forwards the first exit signal as a drain."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.core: subprocess.Popen[bytes] | None = None
        self.front_ends: list[subprocess.Popen[bytes]] = []
        self.stopping = False
        self.deadline = float("inf")  # once stopping: when whatever still runs is killed
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        # a second signal reaches the front ends as their second one: they exit at once
        logger.info(
            "signal %d: %s %d front end(s)",
            sig,
            "stopping" if self.stopping else "draining",
            len(self.front_ends),
        )
        if not self.stopping:
            # a front end still starting (its core loading) cannot drain: it is killed then
            self.deadline = time.monotonic() + self.plan.shutdown_timeout + EXIT_GRACE_S
        self.stopping = True
        for front_end in self.front_ends:
            _signal(front_end, signal.SIGTERM)

    def on_hangup(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: every front end re-reads the API keys file (the core has nothing to read)."""
        logger.info("signal %d: passed on to %d front end(s)", sig, len(self.front_ends))
        for front_end in self.front_ends:
            _signal(front_end, signal.SIGHUP)

    def watch(self) -> int:
        """Block until the server has stopped; 0 after a clean drain."""
        assert self.core is not None
        while True:
            gone = [p for p in self.front_ends if p.poll() is not None]
            if self.core.poll() is not None:
                return self._core_gone()
            if gone and not self.stopping:
                return self._front_end_gone(gone)
            if self.stopping and len(gone) == len(self.front_ends):
                return self._drained()
            if time.monotonic() > self.deadline:
                logger.error("front ends still running at the shutdown deadline: killed")
                for front_end in self.front_ends:
                    if front_end.poll() is None:
                        front_end.kill()
                        front_end.wait()
            time.sleep(WATCH_INTERVAL_S)

    def _core_gone(self) -> int:
        assert self.core is not None
        code = self.core.returncode
        if self.stopping and all(p.poll() is not None for p in self.front_ends):
            return 0 if code == 0 else 1
        if code == START_FAILED_EXIT:  # the core said why; nothing was served, nothing drains
            self.kill_all()
            return 1
        logger.error("the engine core exited (code %s): stopping the server", code)
        for front_end in self.front_ends:
            _signal(front_end, CORE_LOST_SIGNAL)  # its requests answer 503 now
        time.sleep(LOST_CORE_GRACE_S)  # front ends answer 503 meanwhile
        self._stop(self.front_ends)
        return 1

    def _front_end_gone(self, gone: list[subprocess.Popen[bytes]]) -> int:
        assert self.core is not None
        if any(p.returncode == START_FAILED_EXIT for p in gone):  # it said why; nothing served
            self.kill_all()
            return 1
        for front_end in gone:
            logger.error(
                "front end %d exited (code %s): stopping the server",
                front_end.pid,
                front_end.returncode,
            )
        self._stop([*self.front_ends, self.core])
        return 1

    def _drained(self) -> int:
        """Every front end is done; nobody waits for the core's work any more: stop it."""
        assert self.core is not None
        codes = [p.returncode for p in self.front_ends]
        self._stop([self.core])
        logger.info("drained: front ends exited %s, engine core %s", codes, self.core.returncode)
        # a front end our SIGTERM ended by default (-SIGTERM) was still starting: it had not yet
        # set its drain handler, so it had served nothing and had nothing to drain
        clean = all(code in STOPPED_CLEANLY for code in codes) and self.core.returncode == 0
        return 0 if clean else 1

    def _stop(self, processes: list[subprocess.Popen[bytes]]) -> None:
        """SIGTERM, then SIGKILL what has not exited within the shutdown timeout."""
        for process in processes:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + self.plan.shutdown_timeout + EXIT_GRACE_S
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill_all(self) -> None:
        """Nothing outlives the supervisor."""
        for process in [*self.front_ends, *([self.core] if self.core else [])]:
            if process.poll() is None:
                process.kill()
                process.wait()


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    if process.poll() is None:
        process.send_signal(sig)


class ListenError(OSError):
    """The server cannot listen on its host:port (`strerror` says why, naming the address)."""


class PortInUseError(ListenError):
    """Something already listens on the server's host:port."""


def bind_port(host: str, port: int, count: int) -> list[socket.socket]:
    """The listening sockets of `count` front ends: one each, on the same port; PortInUseError,
    naming the address, when anything else listens there (before any model loads).

    Where the kernel offers SO_REUSEPORT, each front end listens on its own socket and the
    kernel spreads new connections over them evenly. On one shared socket the front end that
    wakes first accepts a whole burst of connections (each accepts in a loop), and keep-alive
    clients then load one front end while another idles. Elsewhere they share one socket.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    spread = count > 1 and hasattr(socket, "SO_REUSEPORT")
    if spread and port != 0:
        # SO_REUSEPORT would join another server's listener that set it too, silently sharing
        # its traffic: a plain bind first finds anything listening there
        _bind_one(family, host, port, reuse_port=False).close()
    listeners: list[socket.socket] = []
    for _ in range(count if spread else 1):
        # port 0: the others join the port the first one was given
        at = listeners[0].getsockname()[1] if listeners else port
        listener = _bind_one(family, host, at, reuse_port=spread)
        listener.listen(2048)
        listener.set_inheritable(True)
        listeners.append(listener)
    return listeners if spread else listeners * count


def _bind_one(family: int, host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A socket bound to host:port (SO_REUSEADDR: a previous run's TIME_WAIT is no obstacle)."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                exc.errno, f"{where} is already in use: stop what listens there or pick --port"
            ) from None
        raise ListenError(exc.errno, f"cannot listen on {where}: {exc.strerror}") from None
    return listener


def _child_of_supervisor(parent: int, grace_s: float) -> None:
    """The child stops when the supervisor dies, however it dies.

    The kernel sends SIGTERM (a drain); a child that cannot drain (a front end still waiting
    for its engine core) exits anyway once `grace_s` has passed: nothing outlives the server.
    """
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S * 5)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="poolserve-parent-watch", daemon=True).start()


def _core_main(settings: ServerSettings, address: str) -> None:
    """The engine-core process: load every model, serve each on its socket in `address`, exit
    with the core's code."""
    configure_logging(settings.log_level, settings.log_format)
    fix_mmap_threshold()
    from poolserve.config.core import core_configs
    from poolserve.config.models_file import served_models
    from poolserve.engine.process import serve_core_process  # torch, in this process only

    served = served_models(settings)
    serving = serve_core_process(core_configs(served), address, _observers(served))
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            code = runner.run(serving)
        except ModelStartError as exc:
            report_start_failure("serve", exc)
            code = START_FAILED_EXIT
    logging.shutdown()
    os._exit(code)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed, as uvicorn picks for the front ends: the core's loop turns
    once or more per step and per message, and uvloop's turn costs a fraction of asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _observers(served: ServedModels) -> list[EngineObserver]:
    """Each model's engine observer: its model-labelled children of this process's metrics."""
    from poolserve.observability.metrics import ServiceMetrics

    metrics = ServiceMetrics()
    return [metrics.model(m.name) for m in served.models]


def _front_end_main(settings: ServerSettings, address: str, listener: socket.socket) -> None:
    """A front-end process: the app on the shared socket, served until drained; it reaches each
    model's engine in the core's socket directory `address` (model i: `socket_path(address, i)`)."""
    configure_logging(settings.log_level, settings.log_format)
    fix_mmap_threshold()
    from poolserve.http.edge.server import run_server  # after the malloc setting

    beside: tuple[Any, ...] = ()
    if settings.grpc_port is not None:  # the gRPC server's code loads only when asked for
        from poolserve.grpc.server import beside_http

        beside = beside_http(settings)
    started = run_server(settings, core_address=address, sockets=[listener], beside=beside)
    logging.shutdown()
    os._exit(0 if started else START_FAILED_EXIT)


def _supervise_main(workdir: Path) -> NoReturn:
    """The supervisor's own entry (after `supervise`): serve, and exit with the server's code."""
    plan = Plan.of(json.loads((workdir / SETTINGS_FILE).read_text()))
    configure_logging(plan.log_level, plan.log_format)
    fix_mmap_threshold()
    try:
        code = run_processes(plan, workdir)
    except ListenError as exc:
        print(f"poolserve serve: error: {exc.strerror}", file=sys.stderr)
        code = 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    logging.shutdown()
    os._exit(code)


def main(argv: list[str]) -> None:
    """The entry of `supervise WORKDIR` (the supervisor), and of its children: `core SETTINGS
    ADDRESS` or `api SETTINGS ADDRESS FD` (ADDRESS: the directory of the engine core's sockets)."""
    if argv[0] == "supervise":
        _supervise_main(Path(argv[1]))
    from poolserve.config.settings import ServerSettings
    from poolserve.observability.metrics import fix_process_identity

    role, settings_file, address, *fd = argv
    settings = ServerSettings.model_validate_json(Path(settings_file).read_text())
    _child_of_supervisor(int(os.environ[SUPERVISOR_PID]), settings.shutdown_timeout + EXIT_GRACE_S)
    fix_process_identity()
    if role == "core":
        _core_main(settings, address)
    else:
        _front_end_main(settings, address, socket.socket(fileno=int(fd[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
