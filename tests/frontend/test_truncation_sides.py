"""Both truncation sides keep what whole-text tokenization keeps, on text without spaces."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from poolserve.frontend.truncation import content_windows
from tests.http.serving import assert_close
from tests.tiny_models import minilm_path

# Llama 3's pre-tokenizer pattern: digits in threes, so a cut inside a digit run regroups it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HANZI = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家"
KANA = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
)
KATAKANA = (
    "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワン"
)
KANJI = "日本語東京大学研究開発情報技術自然言語処理機械学習文書検索"
WORDS = ("model", "Embedding", "the", "API", "v2", "GPU", "token", "naïve", "café", "x86_64")
PUNCT = ("，", "。", "、", "；", "！", "？", "：", "（", "）", "・", "「", "」", "-", "/", ".", ",")
WANTS = (1, 5, 64, 300)
SIDES = ("left", "right")
TEXT_CHARS = 6000
MAX_CHARS = 4000  # below every text's length: no window is ever the whole text


def _chinese(rng: random.Random) -> str:
    """Sentences of hanzi between Chinese punctuation, digits now and then, no whitespace."""
    parts = []
    while sum(map(len, parts)) < TEXT_CHARS:
        parts.append("".join(rng.choices(HANZI, k=rng.randrange(3, 25))))
        if rng.random() < 0.1:
            parts.append(str(rng.randrange(10**12)))
        parts.append(rng.choice("，。、；！？"))
    return "".join(parts)


def _japanese(rng: random.Random) -> str:
    """Kanji, hiragana and katakana runs between Japanese punctuation, no whitespace."""
    parts = []
    while sum(map(len, parts)) < TEXT_CHARS:
        alphabet = rng.choice((KANJI, KANA, KATAKANA))
        parts.append("".join(rng.choices(alphabet, k=rng.randrange(2, 15))))
        parts.append(rng.choice(("、", "。", "「", "」", "ー", "", "")))
    return "".join(parts)


def _url(rng: random.Random) -> str:
    """Long URLs joined without spaces: paths, query strings, long digit runs."""
    parts = []
    while sum(map(len, parts)) < TEXT_CHARS:
        path = "/".join(rng.choice(WORDS).lower() for _ in range(rng.randrange(1, 6)))
        query = "&".join(
            f"{rng.choice(WORDS).lower()}={rng.randrange(10 ** rng.randrange(1, 20))}"
            for _ in range(rng.randrange(1, 5))
        )
        parts.append(f"https://example{rng.randrange(100)}.com/{path}?{query}#{rng.randrange(9)}")
    return "".join(parts)


def _mixed(rng: random.Random) -> str:
    """CJK runs, ASCII words, digit runs and punctuation, spaces only now and then."""
    parts = []
    while sum(map(len, parts)) < TEXT_CHARS:
        kind = rng.randrange(4)
        if kind == 0:
            parts.append("".join(rng.choices(HANZI + KANA, k=rng.randrange(1, 30))))
        elif kind == 1:
            parts.append(rng.choice(WORDS))
        elif kind == 2:
            parts.append(str(rng.randrange(10 ** rng.randrange(1, 40))))
        else:
            parts.append(rng.choice(PUNCT))
        if rng.random() < 0.05:
            parts.append(" ")
    return "".join(parts)


def _spaced_tail(rng: random.Random) -> str:
    """Chinese text whose only whitespace is a few characters before its end."""
    return _chinese(rng) + " " + rng.choice(WORDS)


KINDS: dict[str, Callable[[random.Random], str]] = {
    "chinese": _chinese,
    "japanese": _japanese,
    "url": _url,
    "mixed": _mixed,
    "spaced_tail": _spaced_tail,
}


def _byte_level_bpe() -> PreTrainedTokenizerBase:
    """A Llama 3-style byte-level BPE trained here on the texts these tests cut."""
    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    rng = random.Random("corpus")
    corpus = [make(rng) for make in KINDS.values() for _ in range(3)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerBase]:
    """MiniLM's WordPiece and a byte-level BPE, both fast tokenizers without a length limit."""
    found = {
        "wordpiece": AutoTokenizer.from_pretrained(str(minilm_path())),
        "byte_level_bpe": _byte_level_bpe(),
    }
    for tokenizer in found.values():
        tokenizer.model_max_length = 1 << 30
    return found


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", ["wordpiece", "byte_level_bpe"])
def test_windows_of_text_without_spaces_equal_the_whole_text_s_tokens(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str, kind: str
) -> None:
    tokenizer = tokenizers[name]
    rng = random.Random(f"{name}-{kind}")
    for _ in range(2):
        text = KINDS[kind](rng)
        whole = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for side in SIDES:
            for want in WANTS:
                (window,) = content_windows(tokenizer, [text], want, side, MAX_CHARS)
                case = (side, want, window.num_chars, text[:40], text[-40:])
                assert not window.complete and window.num_chars <= MAX_CHARS, case
                assert len(window.ids) >= want, case
                # the whole run is exact, not just the `want` tokens the service keeps
                run = len(window.ids)
                assert window.ids == (
                    whole[:run] if side == "right" else whole[len(whole) - run :]
                ), case


def test_a_cut_inside_a_digit_run_keeps_the_whole_text_s_groups(
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    """Digits grouped in threes from the run's start: a left window never starts mid-run."""
    tokenizer = tokenizers["byte_level_bpe"]
    rng = random.Random("digits")
    for digits in (1, 2, 3, 4, 100, 1001, 2500):
        text = _chinese(rng) + "7" * digits + "，结束。" * 3
        whole = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for want in WANTS:
            (window,) = content_windows(tokenizer, [text], want, "left", MAX_CHARS)
            assert len(window.ids) >= want, (digits, want)
            assert window.ids == whole[len(whole) - len(window.ids) :], (digits, want)


@pytest.fixture(scope="module")
def minilm(make_client: Callable[..., Any]) -> Iterator[Any]:
    """The default model (the bundled MiniLM) with --max-input-chars 8192."""
    with make_client(None, max_input_chars=8192) as client:
        yield client


@pytest.mark.parametrize("side", SIDES)
def test_truncating_long_chinese_text_over_http_keeps_transformers_tokens(
    minilm: Any, side: str
) -> None:
    text = _chinese(random.Random("http"))
    text = (text * (21_000 // len(text) + 1))[:21_000]
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    reference = copy.deepcopy(tokenizer)
    reference.truncation_side = side
    expected = list(reference(text, truncation=True, max_length=64)["input_ids"])
    whole = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    kept = whole[-62:] if side == "left" else whole[:62]
    assert expected == [tokenizer.cls_token_id, *kept, tokenizer.sep_token_id]
    body = {"input": text, "truncate_prompt_tokens": 64, "truncation_side": side}
    response = minilm.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 64
    got = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    assert_close(got, _embed_ids(minilm, expected))


def _embed_ids(client: Any, ids: list[int]) -> np.ndarray:
    response = client.post("/v1/embeddings", json={"input": ids})
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
