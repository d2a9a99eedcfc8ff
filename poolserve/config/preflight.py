"""What can be checked before any process starts, checked there: the models (the flags or the
models file, each model's pooler config, where its files are: a folder, the Hub, the cache), the
TLS files, the API keys file and the batch directory. Each problem is one line that names the
flag, key or model; what needs torch (the architecture, the device, the precision) is the engine
core's to check as it loads."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from poolserve.config.api_keys import read_keys
from poolserve.config.model_path import resolve_model_path
from poolserve.config.models_file import ServedModels, served_models
from poolserve.config.settings import ServerSettings


def preflight(settings: ServerSettings) -> ServedModels:
    """The models the settings serve, each found (a Hub model fetched into the cache); raises
    ModelsConfigError, ModelLoadError or ValueError with the one line to say."""
    if settings.api_keys_file is not None:
        read_keys(settings.api_keys_file, settings.api_key)  # each front end reads it again
    served = served_models(settings)
    for model in served.models:
        model.pooler  # noqa: B018 - parsed (and cached) now: a bad --pooler-config names the model
        resolve_model_path(model.settings.model, model.settings.revision)
    _check_tls(settings)
    _check_batch_dir(settings)
    return served


def _check_batch_dir(settings: ServerSettings) -> None:
    """--batch-dir exists (made if not) and this process may write in it."""
    if settings.batch_dir is None:
        return
    folder = Path(settings.batch_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"--batch-dir {settings.batch_dir!r}: cannot write there ({exc.strerror or exc})"
        ) from exc


def _check_tls(settings: ServerSettings) -> None:
    """The certificate and key load together (the settings checked that both files exist)."""
    if settings.ssl_certfile is None or settings.ssl_keyfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # an encrypted key would make OpenSSL ask for its password on the terminal
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--ssl-certfile {settings.ssl_certfile!r} with --ssl-keyfile "
            f"{settings.ssl_keyfile!r}: cannot load them as a PEM certificate chain and its "
            f"private key ({exc.strerror or exc})"
        ) from exc
