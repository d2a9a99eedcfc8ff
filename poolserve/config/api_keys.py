"""`--api-keys-file`: the API keys of many tenants, read and checked (YAML, or JSON by its
`.json` suffix). Each key has a name (its metrics label and access log field, never the key),
the key itself or its SHA-256 hash, and optional limits, models and routes:

    keys:
      - name: team-a
        key: sha256:3c5d...e1            # the SHA-256 of the key, 64 hex digits
        requests_per_second: 10
        burst: 20                        # default: requests_per_second (at least 1)
        tokens_per_minute: 200000        # prompt tokens
        models: [embedder]               # served model names (a LoRA adapter by its own name)
        routes: [/v1/embeddings, /v1/rerank]
      - name: team-b
        key: [old-key-text, new-key-text]  # several keys share the name, limits and counters

Anything else is refused at start in one line naming the entry and the field; the key's text
never appears in a message. `--api-key` beside the file is one more key, named `default`, with
no limits.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SHA256_PREFIX = "sha256:"
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
# --api-key's name when a keys file is given too
DEFAULT_KEY_NAME = "default"
# a metrics label value and a log field: plain characters only
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# what an Authorization header carries after "Bearer ": printable ASCII without spaces
KEY_TEXT = re.compile(r"[\x21-\x7e]+")


class ApiKeysFileError(ValueError):
    """The keys file cannot be used as it is (one line naming the entry and the field)."""


@dataclass(frozen=True)
class KeySpec:
    """One tenant's keys (as SHA-256 digests), limits, models and routes."""

    name: str
    digests: tuple[bytes, ...]
    requests_per_second: float | None = None
    burst: float | None = None  # requests the key may send at once; None: requests_per_second
    tokens_per_minute: int | None = None
    models: frozenset[str] | None = None  # None: every model
    routes: tuple[str, ...] | None = None  # path prefixes; None: every route

    def allows_route(self, path: str) -> bool:
        """Whether `path` is one of the routes, or under one (at a `/`)."""
        if self.routes is None:
            return True
        return any(path == r or path.startswith(r if r == "/" else r + "/") for r in self.routes)


def digest_of(key: str) -> bytes:
    """The SHA-256 digest that stands for a key's text (its UTF-8 bytes, as --api-key's)."""
    return hashlib.sha256(key.encode()).digest()


class _Key(BaseModel):
    """One entry of the file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    key: list[str] = Field(min_length=1)  # one key's text may stand for a list of one
    requests_per_second: float | None = Field(None, gt=0)
    burst: float | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, gt=0)
    models: list[str] | None = Field(None, min_length=1)
    routes: list[str] | None = Field(None, min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not KEY_NAME.fullmatch(name):
            raise ValueError(
                "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return name

    @field_validator("key", mode="before")
    @classmethod
    def _one_key(cls, key: object) -> object:
        if isinstance(key, str):
            return [key]
        if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
            raise ValueError("must be a key's text or sha256:HEX, or a list of them")
        return key

    @field_validator("key")
    @classmethod
    def _keys(cls, texts: list[str]) -> list[str]:
        for text in texts:  # never echoed: a key is a secret
            if text.startswith(SHA256_PREFIX):
                if not SHA256_HEX.fullmatch(text.removeprefix(SHA256_PREFIX)):
                    raise ValueError("a sha256: key must be 64 hex digits after 'sha256:'")
            elif not KEY_TEXT.fullmatch(text):
                raise ValueError("a key must be printable ASCII without spaces")
        return texts

    @field_validator("models")
    @classmethod
    def _models(cls, models: list[str] | None) -> list[str] | None:
        if models is not None and not all(models):
            raise ValueError("a model name cannot be empty")
        return models

    @field_validator("routes")
    @classmethod
    def _routes(cls, routes: list[str] | None) -> list[str] | None:
        if routes is not None and not all(r.startswith("/") for r in routes):
            raise ValueError("each route must start with /")
        return routes

    def spec(self) -> KeySpec:
        """The entry as the server uses it."""
        if self.burst is not None and self.requests_per_second is None:
            raise ValueError("burst needs requests_per_second")
        return KeySpec(
            name=self.name,
            digests=tuple(_digest(text) for text in self.key),
            requests_per_second=self.requests_per_second,
            burst=self.burst,
            tokens_per_minute=self.tokens_per_minute,
            models=None if self.models is None else frozenset(self.models),
            routes=None if self.routes is None else tuple(_route(r) for r in self.routes),
        )


class _File(BaseModel):
    """The keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    keys: list[_Key] = Field(min_length=1)


def read_keys(path: str, api_key: str | None = None) -> tuple[KeySpec, ...]:
    """The keys of the file at `path`, and `--api-key` as one more named `default`; raises
    ApiKeysFileError with the one line to say."""
    where = f"--api-keys-file {path}"
    data = _parse(path, where)
    if not isinstance(data, dict):
        raise ApiKeysFileError(f"{where}: must be a mapping with a 'keys' list")
    try:
        entries = _File.model_validate(data).keys
    except ValidationError as exc:
        raise ApiKeysFileError(f"{where}: {_problems(exc, data)}") from None
    specs: list[KeySpec] = []
    for index, entry in enumerate(entries):
        try:
            specs.append(entry.spec())
        except ValueError as exc:
            raise ApiKeysFileError(f"{where}: keys[{index}] ({entry.name}): {exc}") from None
    if api_key is not None:
        specs.append(KeySpec(DEFAULT_KEY_NAME, (digest_of(api_key),)))
    _check_unique(specs, where, api_key is not None)
    return tuple(specs)


def _parse(path: str, where: str) -> Any:
    """The file's document: JSON for a `.json` file, else YAML (position only: no text of the
    file, which holds secrets, is quoted)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ApiKeysFileError(f"--api-keys-file: cannot read {path!r}: {reason}") from None
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ApiKeysFileError(
                f"{where}: not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            ) from None
    import yaml  # only with a YAML keys file

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ApiKeysFileError(f"{where}: not YAML: {problem}{at}") from None


def _digest(text: str) -> bytes:
    if text.startswith(SHA256_PREFIX):
        return bytes.fromhex(text.removeprefix(SHA256_PREFIX))
    return digest_of(text)


def _route(route: str) -> str:
    """A prefix without its trailing / (the root stays /)."""
    return route.rstrip("/") or "/"


def _check_unique(specs: list[KeySpec], where: str, with_api_key: bool) -> None:
    """Each name once; each key once (a key of two names would be either's)."""
    names: set[str] = set()
    owners: dict[bytes, str] = {}
    for index, spec in enumerate(specs):
        entry = f"keys[{index}] ({spec.name})"
        if spec.name in names:
            if with_api_key and spec.name == DEFAULT_KEY_NAME:
                raise ApiKeysFileError(
                    f"{where}: the name {DEFAULT_KEY_NAME!r} is --api-key's; name the file's "
                    "key otherwise"
                )
            raise ApiKeysFileError(f"{where}: {entry}: the name is given twice")
        names.add(spec.name)
        for digest in spec.digests:
            owner = owners.setdefault(digest, spec.name)
            if owner != spec.name or spec.digests.count(digest) > 1:
                also = "--api-key" if spec.name == DEFAULT_KEY_NAME and with_api_key else entry
                raise ApiKeysFileError(f"{where}: {also} holds the same key as {owner!r}")


def _problems(exc: ValidationError, data: Any) -> str:
    """pydantic's errors on one line, each naming its entry (and the entry's name) and field."""
    return "; ".join(
        f"{_where(e['loc'], data)}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )


def _where(loc: tuple[int | str, ...], data: Any) -> str:
    """`keys[1] (team-b).requests_per_second` for a location of pydantic's."""
    if len(loc) < 2 or loc[0] != "keys" or not isinstance(loc[1], int):
        return ".".join(str(p) for p in loc) or "file"
    entries = data.get("keys") if isinstance(data, dict) else None
    entry = entries[loc[1]] if isinstance(entries, list) and loc[1] < len(entries) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    named = f" ({name})" if isinstance(name, str) and KEY_NAME.fullmatch(name) else ""
    # within `key`, only the field: the position of one of several keys says little
    field = "key" if loc[2:3] == ("key",) else ".".join(str(p) for p in loc[2:])
    return f"keys[{loc[1]}]{named}" + (f".{field}" if field else "")
