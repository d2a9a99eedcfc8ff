"""CLI: every flag documented, every flag also a POOLSERVE_* variable, flags win."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from poolserve.config.flags import NEGATED_FLAGS, parse_settings
from poolserve.config.settings import ServerSettings
from tests.deploy.tools import REPO_ROOT


def test_help_documents_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poolserve", "serve", "--help"],
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


def test_positional_model_as_vllm_serve_takes_it() -> None:
    assert parse_settings(["serve", "org/model"]).model == "org/model"
    assert parse_settings(["serve", "--model", "org/model"]).model == "org/model"
    assert parse_settings(["serve", "org/model", "--model", "org/model"]).model == "org/model"


def test_positional_model_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLSERVE_MODEL", "from/env")
    assert parse_settings(["serve", "from/flag"]).model == "from/flag"


def test_two_different_models_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(["serve", "org/a", "--model", "org/b"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'org/a'" in err and "'org/b'" in err


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [
        (["--served-model-name", "a", "b"], None, ["a", "b"]),  # vLLM: several after one flag
        (["--served-model-name", "a"], None, ["a"]),
        (["--served-model-name", "a", "b", "a"], None, ["a", "b"]),  # listed once each
        (["--served-model-name", '["a", "b"]'], None, ["a", "b"]),
        ([], "a, b", ["a", "b"]),  # the environment: comma-separated ...
        ([], '["a", "b"]', ["a", "b"]),  # ... or a JSON list
        ([], "solo", ["solo"]),  # a single name, as before
        (["--served-model-name", "flag"], "a,b", ["flag"]),  # flags win
        ([], None, None),
    ],
)
def test_served_model_names_from_flags_and_environment(
    argv: list[str], env: str | None, want: list[str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv("POOLSERVE_SERVED_MODEL_NAME", env)
    assert parse_settings(["serve", *argv]).served_model_name == want


def test_settings_take_a_single_served_name_as_text() -> None:
    assert ServerSettings(served_model_name="m").served_model_names == ("m",)


def test_cors_lists_in_vllm_and_plain_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_settings(["serve"]).allowed_origins == []  # default: no origin is allowed
    settings = parse_settings(
        ["serve", "--allowed-origins", '["https://a.example"]', "--allowed-methods", "GET", "POST"]
    )
    assert settings.allowed_origins == ["https://a.example"]
    assert settings.allowed_methods == ["GET", "POST"]
    assert settings.allowed_headers == ["*"]
    monkeypatch.setenv("POOLSERVE_ALLOWED_ORIGINS", "https://a.example,https://b.example")
    monkeypatch.setenv("POOLSERVE_ALLOW_CREDENTIALS", "true")
    settings = parse_settings(["serve"])
    assert settings.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.allow_credentials is True


def test_auto_truncate_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_settings(["serve"]).auto_truncate is False
    assert parse_settings(["serve", "--auto-truncate"]).auto_truncate is True
    monkeypatch.setenv("POOLSERVE_AUTO_TRUNCATE", "true")
    assert parse_settings(["serve"]).auto_truncate is True
    assert parse_settings(["serve", "--no-auto-truncate"]).auto_truncate is False


def test_revision_and_root_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLSERVE_REVISION", "v1.0")
    settings = parse_settings(["serve", "--root-path", "/poolserve/"])
    assert (settings.revision, settings.root_path) == ("v1.0", "/poolserve")


def test_tls_files_checked_at_startup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    both = parse_settings(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    assert (both.ssl_keyfile, both.ssl_certfile) == (str(key), str(cert))
    refusals = {
        "--ssl-certfile is needed too": ["--ssl-keyfile", str(key)],
        "--ssl-keyfile is needed too": ["--ssl-certfile", str(cert)],
        "--ssl-certfile: no file": ["--ssl-keyfile", str(key), "--ssl-certfile", "/nonexistent"],
    }
    for message, argv in refusals.items():
        with pytest.raises(SystemExit) as exc:
            parse_settings(["serve", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--root-path", "poolserve"],
        ["serve", "--served-model-name", ","],
        ["serve", "--allowed-origins", '{"a": 1}'],
        ["serve", "--allowed-origins", "https://app.example/"],  # never matches an Origin header
        ["serve", "--allowed-origins", '["https://a.example", 3]'],
    ],
)
def test_bad_operator_values_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2


def test_version_flag_prints_the_package_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poolserve", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == version("poolserve")


def test_make_serve_execs_the_server() -> None:
    """The recipe's last command is exec'd, so make's SIGTERM reaches the server (live test:
    test_operator_flags.py)."""
    recipe = (REPO_ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"\bexec \$\(VENV\)/bin/poolserve serve\b", recipe), recipe


def test_every_boolean_setting_is_a_switch() -> None:
    # vLLM's --trust-request-chat-template takes no value; neither does any boolean here
    booleans = [n for n, f in ServerSettings.model_fields.items() if f.annotation is bool]
    assert "trust_request_chat_template" in booleans
    for name in booleans:
        flag = "--" + name.replace("_", "-")
        negated = NEGATED_FLAGS.get(name)
        if negated is not None:
            assert getattr(parse_settings(["serve", negated]), name) is False
            continue
        assert getattr(parse_settings(["serve", flag]), name) is True, flag
        assert getattr(parse_settings(["serve", "--no-" + flag[2:]]), name) is False, flag
