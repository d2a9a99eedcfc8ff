"""Work is bounded before tokenization: character limits, the tokenizing budget, exact windows."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from poolserve.config.flags import parse_settings
from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import TextLimits
from poolserve.frontend.truncation import content_windows, special_tokens
from poolserve.http.app import create_app
from poolserve.types.admission import CharBudget
from poolserve.types.errors import OverloadedError, RequestTooLargeError
from tests.http.serving import assert_close
from tests.tiny_models import MINILM_DIR

MIB = 1 << 20
JSON = {"content-type": "application/json"}
# Qwen2's pre-tokenizer pattern: digits in threes, punctuation swallowing newlines, lookahead.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Words with accents, combining marks, CJK, emoji, digits, punctuation; a long word; whitespace.
WORDS = (
    *("the", "quick", "brown", "über", "naïve", "café", "x", "12345678901234", "hello,world"),
    *("a.b.c", "——", "日本語", "中文字符", "😀🎉", ":-)", "e\u0301", "İstanbul", "ΣΑΣ", "don't"),
    *("1,234,567", "...\n\n", "supercalifragilistic" * 6, "\t", "\n\n", "   ", " " * 8),
)


def _text(rng: random.Random) -> str:
    """Random unicode, words with whitespace runs and long words, CJK runs, or long digit words."""
    kind = rng.randrange(4)
    if kind == 0:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 3000)))
    if kind == 1:
        seps = (" ", "", "  ", "\n", " " * 40)
        return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(rng.randrange(1, 800)))
    if kind == 2:
        return "".join(
            rng.choice("中文日本語한국어字符测试") for _ in range(rng.randrange(1, 2000))
        )
    alphabet = "abcdefghij0123456789"
    words = ("".join(rng.choices(alphabet, k=rng.randrange(1, 300))) for _ in range(50))
    return " ".join(words)


def _byte_level_bpe(corpus: list[str]) -> PreTrainedTokenizerBase:
    """A Qwen-style byte-level BPE with an end-of-text token after every text."""
    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=alphabet, special_tokens=["E"])
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A E", special_tokens=[("E", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="E")


def _unigram(corpus: list[str], split: bool) -> PreTrainedTokenizerBase:
    """A SentencePiece-style Unigram over pieces of the corpus; split=False: one pre-token."""
    rng = random.Random(3)
    text = "".join(corpus).replace(" ", "\u2581")  # Metaspace's space
    pieces = dict.fromkeys(set(text), -10.0)
    for _ in range(2000):  # scored pieces of 2-5 characters, as training would find
        start, size = rng.randrange(len(text) - 6), rng.randrange(2, 6)
        pieces[text[start : start + size]] = -float(rng.randrange(4, 12))
    tokenizer = Tokenizer(models.Unigram([("<unk>", 0.0), *pieces.items()], unk_id=0))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(split=split)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers_under_test() -> dict[str, PreTrainedTokenizerBase]:
    """MiniLM's WordPiece plus byte-level BPE and Unigram tokenizers built here."""
    rng = random.Random(7)
    corpus = [_text(rng) for _ in range(80)]
    found: dict[str, PreTrainedTokenizerBase] = {
        "wordpiece": AutoTokenizer.from_pretrained(str(MINILM_DIR)),
        "byte_level_bpe": _byte_level_bpe(corpus),
        "unigram": _unigram(corpus, split=True),
        "unsplit_unigram": _unigram(corpus, split=False),
    }
    for tokenizer in found.values():
        tokenizer.model_max_length = 1 << 30
    return found


@pytest.mark.parametrize("name", ["wordpiece", "byte_level_bpe", "unigram", "unsplit_unigram"])
def test_windows_keep_exactly_what_whole_text_truncation_keeps(
    tokenizers_under_test: dict[str, PreTrainedTokenizerBase], name: str
) -> None:
    tokenizer = tokenizers_under_test[name]
    specials = special_tokens(tokenizer)
    rng = random.Random(name)
    # whole-text Unigram without word splits is slow on long texts: fewer of them
    texts = [_text(rng) for _ in range(15 if name == "unsplit_unigram" else 60)]
    windowed = 0
    for side in ("left", "right"):
        reference = copy.deepcopy(tokenizer)
        reference.truncation_side = side
        for text in texts:
            keep = rng.choice([len(specials) + 1, 8, 50, 256])
            want = keep - len(specials)
            (window,) = content_windows(tokenizer, [text], want, side, 1 << 30)
            kept = window.ids[:want] if side == "right" else window.ids[-want:]
            got = [*specials.prefix, *kept, *specials.suffix]
            assert got == reference(text, truncation=True, max_length=keep)["input_ids"]
            assert window.complete or window.num_chars < len(text)
            windowed += not window.complete
    # a tokenizer that never splits into words can only be exact on the whole text
    assert (windowed == 0) == (name == "unsplit_unigram")


def test_a_prefix_proves_a_prompt_too_long(
    tokenizers_under_test: dict[str, PreTrainedTokenizerBase],
) -> None:
    tokenizer = tokenizers_under_test["wordpiece"]
    text = "many words of a long document " * 20000
    (window,) = content_windows(tokenizer, [text], 513, "right", 1 << 30)
    assert not window.complete and len(window.ids) >= 513
    assert window.ids[:513] == tokenizer(text, add_special_tokens=False)["input_ids"][:513]
    assert window.num_chars < 10_000


class RecordingTokenizer:
    """Delegates to a tokenizer and records the length of every text it is given."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def __call__(self, texts: str | list[str], **kwargs: Any) -> Any:
        self.lengths.extend(len(t) for t in ([texts] if isinstance(texts, str) else texts))
        return self.inner(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def bert(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client("bert", max_model_len=64, max_input_chars=2000, max_request_chars=3000) as c:
        yield c


def _error(response: Any, status: int, param: str, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = dict(response.json()["error"])
    assert error["param"] == param, error
    assert code is None or error["code"] == code, error
    return error


def test_the_tokenizer_never_sees_more_than_the_limit(bert: Any) -> None:
    state = bert.app.state.poolserve
    original = state.default
    recorder = RecordingTokenizer(original.handle.tokenizer)
    handle = dataclasses.replace(original.handle, tokenizer=recorder)
    recording = dataclasses.replace(original, handle=handle)
    state.serve((recording,), recording)
    try:
        huge = "word " * (2 * MIB)
        body = {"input": huge, "truncate_prompt_tokens": 8}
        assert bert.post("/v1/embeddings", json=body).status_code == 200
        assert max(recorder.lengths) <= (8 - 2) * 8 + 64  # the first window sufficed
        long_text = "a long document " * 120  # 1920 characters, far more than 64 tokens
        error = _error(bert.post("/v1/embeddings", json={"input": long_text}), 400, "input")
        assert "more than 64 tokens" in error["message"]
        assert max(recorder.lengths) < len(long_text)  # refused after a prefix
        seen = len(recorder.lengths)
        _error(bert.post("/v1/embeddings", json={"input": "x" * 2001}), 400, "input")
        _error(bert.post("/tokenize", json={"prompt": "x" * 2001}), 400, "prompt")
        assert len(recorder.lengths) == seen  # refused before any tokenization
    finally:
        state.serve((original,), original)
    assert max(recorder.lengths) <= 2000


def _peak_rss_growth_mib(send: Callable[[], Any]) -> tuple[Any, float]:
    """Peak resident memory during send() above the resident memory before it, in MiB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to now
    except OSError:
        pytest.skip("cannot reset the peak resident memory here")

    def status(field: str) -> int:
        line = next(
            x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field)
        )
        return int(line.split()[1])

    before = status("VmRSS:")
    result = send()
    return result, (status("VmHWM:") - before) / 1024


def test_a_10_mib_input_is_refused_with_little_memory(make_client: Callable[..., Any]) -> None:
    text = ("the quick brown fox jumps over the lazy dog " * 250_000)[: 10 * MIB]
    bodies = [
        orjson.dumps({"input": text}),
        orjson.dumps({"input": text, "truncate_prompt_tokens": 8}),
    ]
    with make_client("bert") as client:  # default limits: 64 characters per token of 512
        refused, growth = _peak_rss_growth_mib(
            lambda: client.post("/v1/embeddings", content=bodies[0], headers=JSON)
        )
        error = _error(refused, 400, "input", "context_length_exceeded")
        assert "32768 (--max-input-chars)" in error["message"]
        assert growth < 100
        truncated, growth = _peak_rss_growth_mib(
            lambda: client.post("/v1/embeddings", content=bodies[1], headers=JSON)
        )
        assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 8
        assert growth < 100


def test_request_character_limit_is_413(bert: Any) -> None:
    error = _error(bert.post("/v1/embeddings", json={"input": ["ab " * 500] * 3}), 413, "input")
    assert error["code"] == "payload_too_large" and "--max-request-chars" in error["message"]


def test_truncated_inputs_cost_at_most_max_input_chars(bert: Any) -> None:
    body = {"input": ["ab " * 5000], "truncate_prompt_tokens": 8}  # 15000 chars, counted as 2000
    assert bert.post("/v1/embeddings", json=body).status_code == 200


def test_tokenizing_budget_refuses_with_retry_after(bert: Any) -> None:
    budget = bert.app.state.poolserve.model.tokenizing
    budget.reserve(budget.max_chars - 10)  # as if other requests were tokenizing
    try:
        response = bert.post("/v1/embeddings", json={"input": "more than ten characters"})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        assert bert.post("/v1/embeddings", json={"input": "short"}).status_code == 200
        assert bert.post("/v1/embeddings", json={"input": [[101, 7592, 102]]}).status_code == 200
    finally:
        budget.release(budget.max_chars - 10)
    assert budget.in_flight == 0


def test_char_budget_counts_and_refuses() -> None:
    budget = CharBudget(100)
    budget.reserve(60)
    with pytest.raises(OverloadedError):
        budget.reserve(41)
    with pytest.raises(RequestTooLargeError):
        budget.reserve(101)
    budget.reserve(40)
    budget.release(100)
    assert budget.in_flight == 0
    with pytest.raises(ValueError):
        budget.release(1)


def test_limits_are_derived_from_max_model_len_and_checked() -> None:
    assert TextLimits.derive(ServerSettings(), 512) == TextLimits(32768, MIB, 2 * MIB)
    assert TextLimits.derive(ServerSettings(), 32768) == TextLimits(2 * MIB, 2 * MIB, 4 * MIB)
    # derived defaults bend to smaller explicit limits above them
    assert TextLimits.derive(ServerSettings(max_request_chars=1000), 512).max_input_chars == 1000
    limits = TextLimits.derive(ServerSettings(max_tokenizing_chars=20000), 512)
    assert limits == TextLimits(20000, 20000, 20000)
    with pytest.raises(ValueError, match="max-input-chars"):
        TextLimits.derive(ServerSettings(max_input_chars=10, max_request_chars=5), 512)
    with pytest.raises(ValueError, match="max-tokenizing-chars"):
        TextLimits.derive(ServerSettings(max_request_chars=10, max_tokenizing_chars=5), 512)


def test_character_flags() -> None:
    settings = parse_settings(
        [
            "serve",
            "--max-input-chars",
            "5",
            "--max-request-chars",
            "6",
            "--max-tokenizing-chars",
            "7",
        ]
    )
    assert (
        settings.max_input_chars,
        settings.max_request_chars,
        settings.max_tokenizing_chars,
    ) == (
        5,
        6,
        7,
    )


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"input": "a\\ud800b"}', "input"),
        (b'{"input": ["fine", "\\udfff"]}', "input"),
        (b'{"prompt": "x\\ud800"}', "prompt"),
    ],
)
def test_unencodable_text_is_400(bert: Any, raw: bytes, param: str) -> None:
    path = "/tokenize" if param == "prompt" else "/v1/embeddings"
    error = _error(bert.post(path, content=raw, headers=JSON), 400, param)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/embeddings", {"input": [2**63]}, "input"),
        ("/v1/embeddings", {"input": [[5], [2**31]]}, "input"),
        ("/v1/embeddings", {"input": [1, -1]}, "input"),
        ("/v1/pooling", {"input": [5, 2**64]}, "input"),
        ("/v1/pooling", {"input": "a", "returned_token_ids": [2**63]}, "returned_token_ids"),
        ("/v1/pooling", {"input": "a", "step_tag_id": 2**63}, "step_tag_id"),
        ("/detokenize", {"tokens": [2**63]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_huge_or_negative_token_ids_are_400(
    bert: Any, path: str, body: dict[str, Any], param: str
) -> None:
    _error(bert.post(path, json=body), 400, param)


def test_truncation_below_the_special_tokens_is_400(bert: Any) -> None:
    body = {"input": "hello world", "truncate_prompt_tokens": 2}  # [CLS] and [SEP] alone
    _error(bert.post("/v1/embeddings", json=body), 400, "truncate_prompt_tokens")


def test_truncation_side_defaults_to_the_tokenizer_s(
    bert: Any, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    text = "one two three four five six seven eight nine ten"
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    ids = {side: _ids_truncated(tokenizer, text, side) for side in ("left", "right")}
    default = _embed(bert, input=text, truncate_prompt_tokens=6)
    assert_close(default, _embed(bert, input=ids["right"]))
    left = _embed(bert, input=text, truncate_prompt_tokens=6, truncation_side="left")
    assert_close(left, _embed(bert, input=ids["left"]))
    whole = list(tokenizer(text)["input_ids"])
    # token ids follow the same rule: the tokenizer's side unless the request names one
    assert_close(_embed(bert, input=whole, truncate_prompt_tokens=6), _embed(bert, input=whole[:6]))
    directory = shutil.copytree(tiny_model_dir("bert"), tmp_path / "left")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["truncation_side"] = "left"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    settings = ServerSettings(model=str(directory), max_model_len=64)
    with TestClient(create_app(settings)) as client:
        assert_close(_embed(client, input=text, truncate_prompt_tokens=6), left)
        tail = _embed(client, input=whole[-6:])
        assert_close(_embed(client, input=whole, truncate_prompt_tokens=6), tail)


def _embed(client: Any, **body: Any) -> np.ndarray:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)


def _ids_truncated(tokenizer: PreTrainedTokenizerBase, text: str, side: str) -> list[int]:
    reference = copy.deepcopy(tokenizer)
    reference.truncation_side = side
    return list(reference(text, truncation=True, max_length=6)["input_ids"])
