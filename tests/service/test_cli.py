"""CLI: every flag documented, every flag also a POOLSERVE_* variable, flags win."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.cli import parse_settings
from service.settings import ServerSettings


def test_help_documents_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    for name in ServerSettings.model_fields:
        flag = (
            "--no-async-scheduling" if name == "async_scheduling" else "--" + name.replace("_", "-")
        )
        assert flag in result.stdout
        assert f"POOLSERVE_{name.upper()}" in result.stdout


def test_environment_sets_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("POOLSERVE_PORT", "1111")
    monkeypatch.setenv("POOLSERVE_ASYNC_SCHEDULING", "false")
    settings = parse_settings(["serve", "--port", "2222", "--api-key", "k"])
    assert (settings.max_num_seqs, settings.port, settings.api_key) == (7, 2222, "k")
    assert settings.async_scheduling is False


def test_no_async_scheduling_flag() -> None:
    assert parse_settings(["serve"]).async_scheduling is True
    assert parse_settings(["serve", "--no-async-scheduling"]).async_scheduling is False


def test_prefix_caching_flags() -> None:
    assert parse_settings(["serve"]).enable_prefix_caching is True
    assert parse_settings(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_settings(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize(
    "argv", [["serve", "--port", "-5"], ["serve", "--device", "tpu"], ["serve", "--bogus"]]
)
def test_bad_values_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err
