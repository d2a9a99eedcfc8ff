"""The command line's first answers: --help in sections, the flags each command takes, an unknown
flag answered by its subcommand, and all of it fast and without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from typing import Literal, get_args, get_origin

import pytest

from poolserve.cli import build_parser, main
from poolserve.config.flags import EVERY_COMMAND, GROUPS, SERVE_ONLY, settings_of
from poolserve.config.settings import ServerSettings
from tests.deploy.tools import REPO_ROOT

# A fresh interpreter's answer; --help loads pydantic but no torch (well under a second idle,
# bounded loosely here so a busy test machine does not fail it; torch alone takes longer).
MOST_SECONDS = 3.0


def _poolserve(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "poolserve", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    return result, time.perf_counter() - start


def _subcommand(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = action.choices[name]
    return parser


def _setting_dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions} & set(ServerSettings.model_fields)


def test_every_setting_is_in_exactly_one_group() -> None:
    """A new setting without a section (or in two) fails here, not silently in --help."""
    counts = Counter(name for group in GROUPS for name in group.settings)
    assert {name: n for name, n in counts.items() if n != 1} == {}
    assert set(counts) == set(ServerSettings.model_fields)
    assert len({g.title for g in GROUPS}) == len(GROUPS)
    assert all(g.commands <= EVERY_COMMAND and "serve" in g.commands for g in GROUPS)


@pytest.mark.parametrize("command", sorted(EVERY_COMMAND))
def test_each_command_takes_the_flags_of_its_sections(command: str) -> None:
    assert _setting_dests(_subcommand(command)) == set(settings_of(command))


def test_the_jobs_take_no_flag_of_the_http_server() -> None:
    serve_only = {name for g in GROUPS if g.commands == SERVE_ONLY for name in g.settings}
    assert {"port", "host", "ssl_keyfile", "allowed_origins", "api_key"} <= serve_only
    assert {"api_server_count", "access_log", "otlp_traces_endpoint"} <= serve_only
    for job in ("embed", "run-batch"):
        assert not _setting_dests(_subcommand(job)) & serve_only
    # run-batch's lines are requests: their bounds and model names apply; embed runs one model
    assert {"payload_limit", "models"} <= _setting_dests(_subcommand("run-batch"))
    assert not {"payload_limit", "models"} & _setting_dests(_subcommand("embed"))
    assert {"model", "dtype", "device", "max_num_seqs", "log_level"} <= _setting_dests(
        _subcommand("embed")
    )


def test_choices_come_from_the_settings_annotations() -> None:
    """Every Literal setting lists its values; argparse refuses another one (exit 2)."""
    actions = {a.dest: a for a in _subcommand("serve")._actions}
    literal = {}
    for name, field in ServerSettings.model_fields.items():
        for kind in (field.annotation, *get_args(field.annotation)):
            if get_origin(kind) is Literal:
                literal[name] = list(get_args(kind))
    assert {"device", "dtype", "quantization", "log_level", "log_format"} <= set(literal)
    assert {name: actions[name].choices for name in literal} == literal


def test_serve_help_is_in_sections_with_choices_and_fast() -> None:
    result, seconds = _poolserve("serve", "--help")
    assert result.returncode == 0 and seconds < MOST_SECONDS, (seconds, result.stderr)
    headings = [line[:-1] for line in result.stdout.splitlines() if line[:1].isalpha()]
    assert headings[-len(GROUPS) :] == [g.title for g in GROUPS]
    assert "--dtype {auto,float32,bfloat16,float16}" in result.stdout
    assert "--log-format {text,json}" in result.stdout
    assert "--quantization {int8,fp8}" in result.stdout


def test_unknown_flag_is_answered_by_its_subcommand() -> None:
    result, seconds = _poolserve("serve", "--max-model-lenn", "512")
    assert result.returncode == 2 and seconds < MOST_SECONDS
    assert result.stderr.startswith("usage: poolserve serve ")
    assert "poolserve serve: error: unrecognized arguments: --max-model-lenn" in result.stderr
    assert "(did you mean --max-model-len?)" in result.stderr


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (
            ["embed", "c.jsonl", "-o", "o.parquet", "--port", "1"],
            "poolserve embed",
            "--port is a flag of poolserve serve",
        ),
        (
            ["embed", "c.jsonl", "-o", "o.parquet", "--models", "m"],
            "poolserve embed",
            "poolserve run-batch, poolserve serve",
        ),
        (
            ["run-batch", "-i", "a", "-o", "b", "--dtpye", "float32"],
            "poolserve run-batch",
            "did you mean --dtype?",
        ),
        (
            ["run-batch", "-i", "a", "-o", "b", "--api-key=k"],
            "poolserve run-batch",
            "--api-key is a flag of poolserve serve",
        ),
    ],
)
def test_unknown_flag_of_a_job(
    argv: list[str], usage: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ") and f"{usage}: error: unrecognized" in err
    assert hint in err
