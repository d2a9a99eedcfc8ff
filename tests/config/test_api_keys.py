"""--api-keys-file read and checked: YAML and JSON, keys given or hashed, each mistake refused in
one line naming the entry and the field, never the key's text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from poolserve.config.api_keys import ApiKeysFileError, KeySpec, digest_of, read_keys

SECRET = "sk-tenant-a-0123456789"
HASHED = "sha256:" + hashlib.sha256(b"sk-tenant-b-9876543210").hexdigest()


def _read(tmp_path: Path, text: str, suffix: str = ".yaml", **kwargs: str) -> tuple[KeySpec, ...]:
    path = tmp_path / f"keys{suffix}"
    path.write_text(text)
    return read_keys(str(path), **kwargs)


def test_a_file_of_keys_given_and_hashed(tmp_path: Path) -> None:
    text = f"""
keys:
  - name: team-a
    key: {SECRET}
    requests_per_second: 5
    burst: 10
    tokens_per_minute: 1000
    models: [embedder, reranker]
    routes: [/v1/embeddings/, /v1/rerank]
  - name: team-b
    key: [{HASHED}, other-key]
"""
    a, b = _read(tmp_path, text)
    assert a == KeySpec(
        "team-a",
        (digest_of(SECRET),),
        5.0,
        10.0,
        1000,
        frozenset({"embedder", "reranker"}),
        ("/v1/embeddings", "/v1/rerank"),
    )
    assert b.digests == (hashlib.sha256(b"sk-tenant-b-9876543210").digest(), digest_of("other-key"))
    assert (b.requests_per_second, b.tokens_per_minute, b.models, b.routes) == (None,) * 4


def test_json_by_its_suffix(tmp_path: Path) -> None:
    text = '{\n\t"keys": [{"name": "a", "key": "k1", "requests_per_second": 0.5}]\n}'
    (spec,) = _read(tmp_path, text, ".json")  # a tab YAML would refuse: JSON's own parser
    assert spec.requests_per_second == 0.5


def test_api_key_beside_the_file_is_one_more_key_named_default(tmp_path: Path) -> None:
    specs = _read(tmp_path, "keys: [{name: a, key: k1}]", api_key="the-old-key")
    assert specs[-1] == KeySpec("default", (digest_of("the-old-key"),))


def test_routes_match_whole_segments() -> None:
    spec = KeySpec("a", (), routes=("/v1/embeddings", "/v2"))
    assert spec.allows_route("/v1/embeddings")
    assert spec.allows_route("/v2/rerank")
    assert not spec.allows_route("/v1/embeddingsX")
    assert not spec.allows_route("/v1/pooling")
    assert KeySpec("b", (), routes=("/",)).allows_route("/anything")
    assert KeySpec("c", ()).allows_route("/anything")


BAD = [
    ("keys:\n - {name: a, key: k, requests_per_second: 0}", "keys[0] (a).requests_per_second: "),
    ("keys:\n - {name: a, key: k, requests_per_second: '5'}", "keys[0] (a).requests_per_second: "),
    ("keys:\n - {name: a, key: k, tokens_per_minute: 1.5}", "keys[0] (a).tokens_per_minute: "),
    ("keys:\n - {name: a, key: k, colour: red}", "keys[0] (a).colour: Extra inputs"),
    ("keys:\n - {name: a, key: k, burst: 3}", "keys[0] (a): burst needs requests_per_second"),
    ("keys:\n - {name: a, key: k, models: []}", "keys[0] (a).models: "),
    ("keys:\n - {name: a, key: k, routes: [v1/embeddings]}", "keys[0] (a).routes: each route"),
    ("keys:\n - {name: a b, key: k}", "keys[0].name: must be 1 to 64 letters"),
    ("keys:\n - {name: a, key: 'sha256:abc'}", "keys[0] (a).key: a sha256: key must be 64 hex"),
    ("keys:\n - {name: a, key: 'two words'}", "keys[0] (a).key: a key must be printable"),
    ("keys:\n - {name: a, key: 7}", "keys[0] (a).key: must be a key's text"),
    ("keys:\n - {name: a}", "keys[0] (a).key: Field required"),
    ("keys:\n - {name: a, key: k}\n - {name: a, key: j}", "keys[1] (a): the name is given twice"),
    ("keys:\n - {name: a, key: k}\n - {name: b, key: k}", "keys[1] (b) holds the same key as 'a'"),
    ("keys: []", "keys: List should have at least 1 item"),
    ("- a\n- b", "must be a mapping with a 'keys' list"),
    ("keys: [\n", "not YAML: "),
]


@pytest.mark.parametrize("text,said", BAD)
def test_mistakes_are_one_line_naming_the_entry(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ApiKeysFileError) as caught:
        _read(tmp_path, text)
    message = str(caught.value)
    assert message.startswith(f"--api-keys-file {tmp_path / 'keys.yaml'}: {said}"), message
    assert "\n" not in message
    assert "two words" not in message  # a key's text is never said


def test_clashes_with_api_key_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysFileError, match="the name 'default' is --api-key's"):
        _read(tmp_path, "keys: [{name: default, key: k1}]", api_key="k2")
    with pytest.raises(ApiKeysFileError, match="--api-key holds the same key as 'a'"):
        _read(tmp_path, "keys: [{name: a, key: k1}]", api_key="k1")


def test_an_unreadable_file_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysFileError, match=r"--api-keys-file: cannot read .*No such file"):
        read_keys(str(tmp_path / "gone.yaml"))
    with pytest.raises(ApiKeysFileError, match=r"not JSON: .* at line 1, column \d+$"):
        _read(tmp_path, '{"keys": [{"name": "a", "key": "sk-secret",]}', ".json")


def test_a_yaml_error_quotes_no_text_of_the_file(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysFileError) as caught:
        _read(tmp_path, "keys:\n - name: a\n   key: sk-secret-text\n  oops: [\n")
    assert "sk-secret-text" not in str(caught.value)
    assert "at line 4" in str(caught.value)
