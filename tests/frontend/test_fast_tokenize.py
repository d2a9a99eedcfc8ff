"""The fast path (the Rust backend called directly) gives transformers' tokenizer() ids exactly."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy
from transformers.models.nllb.tokenization_nllb import NllbTokenizer

from poolserve.frontend.texts import (
    NO_SPECIALS,
    InputTooLongError,
    Truncation,
    encode_texts,
)
from poolserve.frontend.truncation import (
    POOLED_CHARS,
    backend_of,
    encode_batch,
    runs_backend_directly,
    special_tokens,
)
from poolserve.models.loader import load_model
from tests.http.serving import assert_close
from tests.tiny_models import minilm_path, save_tiny_model, write_st_modules

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SHORT_TEXTS = (
    "",
    " ",
    "   \t\n  ",
    "\u00a0\u2003\u3000",  # no-break, em and ideographic spaces only
    "hello",
    "the quick brown fox jumps over the lazy dog near the river bank today",
    "Hello WORLD, Ünïcödé ÀÉÎÕÜ naïve café façade",
    "e\u0301 vs \u00e9 and \ufb01 ligature, \u212b angstrom",
    "日本語の文章です。中文句子，没有空格。한국어 문장입니다",
    "👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇫🇷 keycap 1\ufe0f\u20e3 🤖🤖🤖",
    "مرحبا بالعالم — שלום עולם",
    "numbers 1234567890 3.14159 1,000,000 and x86_64 v2.0-rc1",
    "[CLS] [SEP] [MASK] <s> </s> <pad> <|begin_of_text|> literal special tokens",
    "tabs\tand\nnew\r\nlines\u2028separators",
    "control \x00\x07\x1b characters and zero\u200bwidth",
    "https://example.com/path?query=1&b=2#frag user@example.org",
    "MiXeD CaSe WoRdS ThAt LoWeRcAsInG ChAnGeS",
)
HANZI = "的一是不了人我在有他这中大来上国个到说们为子和你"
WORDS = ("model", "Embedding", "the", "API", "v2", "GPU", "token", "naïve", "café", "x86_64")


def _long_text(rng: random.Random, num_chars: int) -> str:
    """Words, CJK runs, emoji, digits and punctuation, spaces most of the time."""
    parts: list[str] = []
    while sum(map(len, parts)) < num_chars:
        kind = rng.randrange(5)
        if kind == 0:
            parts.append(
                "".join(rng.choices("的一是不了人我在有他这中大来上国个到说们为子和你", k=9))
            )
        elif kind == 1:
            parts.append(rng.choice(WORDS))
        elif kind == 2:
            parts.append(str(rng.randrange(10 ** rng.randrange(1, 15))))
        elif kind == 3:
            parts.append(rng.choice(("🙂", "👍🏽", "。", ",", "!", "—", "\n")))
        else:
            parts.append(rng.choice(SHORT_TEXTS[5:8]))
        parts.append(" " if rng.random() < 0.8 else "")
    return "".join(parts)[:num_chars]


TEXTS = (
    *SHORT_TEXTS,
    _long_text(random.Random(1), 3_000),
    _long_text(random.Random(2), 40_000),
    "word " * 6_000,
)


def _corpus() -> list[str]:
    rng = random.Random(0)
    return [*SHORT_TEXTS, *(_long_text(rng, 2_000) for _ in range(10))]


def _fast(tokenizer: Tokenizer, **specials: str) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    wrapped.model_max_length = 1 << 30
    return wrapped


def _roberta() -> PreTrainedTokenizerBase:
    """RoBERTa's layout: byte-level BPE with a prefix space, <s> A </s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return _fast(tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _llama3() -> PreTrainedTokenizerBase:
    """Llama 3's layout: a regex split, byte-level BPE, a BOS token (Qwen's without the BOS)."""
    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    bos = "<|begin_of_text|>"
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=[bos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 0)]
    )
    return _fast(tokenizer, bos_token=bos)


def _xlm_r() -> PreTrainedTokenizerBase:
    """XLM-R's layout: SentencePiece Unigram behind Metaspace, <s> A </s>."""
    rng = random.Random(3)
    text = "".join(_corpus()).replace(" ", "\u2581")
    pieces = dict.fromkeys(set(text), -10.0)
    for _ in range(3000):  # scored pieces of 2-5 characters, as training would find
        start, size = rng.randrange(len(text) - 6), rng.randrange(2, 6)
        pieces[text[start : start + size]] = -float(rng.randrange(4, 12))
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces.items()]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=3))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return _fast(tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _llama2() -> PreTrainedTokenizerBase:
    """Llama 2's layout: SentencePiece BPE with byte fallback, no pre-tokenizer, a BOS token."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    trained.train_from_iterator(
        [t.replace(" ", "\u2581") for t in _corpus()],
        trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    document = json.loads(trained.to_str())
    vocab = document["model"]["vocab"]
    for byte in range(256):  # the byte pieces a SentencePiece BPE falls back to
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    document["model"].update(byte_fallback=True, unk_token="<unk>")
    document["pre_tokenizer"] = None
    tokenizer = Tokenizer.from_str(json.dumps(document))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return _fast(tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _minilm() -> PreTrainedTokenizerBase:
    """MiniLM's WordPiece (BertTokenizer), fresh: its tokenizer.json truncates and pads at 128."""
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    tokenizer.model_max_length = 1 << 30
    return tokenizer


def _do_lower_case(tmp_path: Path) -> PreTrainedTokenizerBase:
    """A cased WordPiece lowered by sentence-transformers' do_lower_case, as the loader does it."""
    directory = save_tiny_model("bert", tmp_path / "lower")
    write_st_modules(directory, max_seq_length=None, do_lower_case=True, cased_tokenizer=True)
    tokenizer = copy.deepcopy(load_model(str(directory), device=torch.device("cpu")).tokenizer)
    tokenizer.model_max_length = 1 << 30
    return tokenizer


BUILDERS: dict[str, Callable[[], PreTrainedTokenizerBase]] = {
    "wordpiece": _minilm,
    "roberta_bpe": _roberta,
    "llama3_bpe": _llama3,
    "xlm_r_unigram": _xlm_r,
    "llama2_sentencepiece": _llama2,
}
FAMILIES = (*BUILDERS, "do_lower_case")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PreTrainedTokenizerBase]:
    """Every tokenizer family, each freshly built (backend settings as its tokenizer.json has)."""
    built = {name: build() for name, build in BUILDERS.items()}
    built["do_lower_case"] = _do_lower_case(tmp_path_factory.mktemp("st"))
    return built


def _reference(tokenizer: PreTrainedTokenizerBase, text: str, **kwargs: Any) -> list[int]:
    """transformers' own answer, from a copy so the fast path never sees the wrapper's settings."""
    return list(copy.deepcopy(tokenizer)(text, **kwargs)["input_ids"])


def _handle(tokenizer: PreTrainedTokenizerBase, max_model_len: int = 1 << 20) -> Any:
    """What encode_texts reads of a ModelHandle."""
    return SimpleNamespace(
        tokenizer=tokenizer,
        specials=special_tokens(tokenizer),
        max_model_len=max_model_len,
        limits=SimpleNamespace(max_input_chars=1 << 20),
    )


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_batch_equals_transformers_ids_and_words(
    families: dict[str, PreTrainedTokenizerBase], name: str, add_special_tokens: bool
) -> None:
    fresh = copy.deepcopy(families[name])  # first call on backend settings from the file
    assert backend_of(fresh) is not None
    reference = copy.deepcopy(fresh)
    got = encode_batch(fresh, TEXTS, add_special_tokens, with_words=True)
    ids_only = encode_batch(fresh, TEXTS, add_special_tokens)
    expected = reference(list(TEXTS), add_special_tokens=add_special_tokens)
    for j, text in enumerate(TEXTS):
        assert got[j].ids == ids_only[j].ids == list(expected["input_ids"][j]), (name, text[:40])
        assert got[j].word_ids == expected.word_ids(j), (name, text[:40])
        # one text alone, as the service encodes a single input
        assert encode_batch(fresh, [text], add_special_tokens)[0].ids == got[j].ids
    # a few short texts together are encoded one by one, not on the backend's thread pool
    assert sum(map(len, SHORT_TEXTS)) <= POOLED_CHARS < sum(map(len, TEXTS))
    short = encode_batch(fresh, SHORT_TEXTS, add_special_tokens, with_words=True)
    assert [t.ids for t in short] == [t.ids for t in got[: len(SHORT_TEXTS)]]
    assert [t.word_ids for t in short] == [t.word_ids for t in got[: len(SHORT_TEXTS)]]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("side", ["right", "left"])
def test_truncated_prompts_equal_transformers_truncation(
    families: dict[str, PreTrainedTokenizerBase], name: str, add_special_tokens: bool, side: str
) -> None:
    tokenizer = copy.deepcopy(families[name])
    model = _handle(tokenizer)
    specials = model.specials if add_special_tokens else NO_SPECIALS
    reference = copy.deepcopy(tokenizer)
    reference.truncation_side = side
    for keep in (len(specials) + 1, 8, 64):
        got = encode_texts(model, TEXTS, Truncation(keep, side), specials)  # type: ignore[arg-type]
        for text, ids in zip(TEXTS, got, strict=True):
            expected = reference(
                text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep
            )["input_ids"]
            assert ids == list(expected), (name, side, keep, text[:40])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_whole_prompts_equal_transformers_and_long_ones_are_refused(
    families: dict[str, PreTrainedTokenizerBase], name: str, add_special_tokens: bool
) -> None:
    tokenizer = copy.deepcopy(families[name])
    model = _handle(tokenizer)
    specials = model.specials if add_special_tokens else NO_SPECIALS
    got = encode_texts(model, TEXTS, Truncation(None, "right"), specials)  # type: ignore[arg-type]
    for text, ids in zip(TEXTS, got, strict=True):
        assert ids == _reference(tokenizer, text, add_special_tokens=add_special_tokens)
    limit = 64
    short = _handle(tokenizer, max_model_len=limit)
    for text in TEXTS:
        expected = _reference(tokenizer, text, add_special_tokens=add_special_tokens)
        truncation = Truncation(None, "right", limit)
        if len(expected) > limit:
            with pytest.raises(InputTooLongError):
                encode_texts(short, [text], truncation, specials)
        else:
            assert encode_texts(short, [text], truncation, specials) == [expected]


def test_lowercasing_follows_do_lower_case(families: dict[str, PreTrainedTokenizerBase]) -> None:
    lowered = families["do_lower_case"]
    cased = copy.deepcopy(lowered)
    cased.backend_tokenizer.normalizer = cased.backend_tokenizer.normalizer[1]  # type: ignore[index]
    text = "MiXeD CaSe WoRdS ThAt LoWeRcAsInG ChAnGeS"
    got = encode_batch(lowered, [text], add_special_tokens=True)[0].ids
    assert got == _reference(cased, text.lower()) != _reference(cased, text)


@pytest.mark.parametrize("split", [False, True])
def test_split_special_tokens_is_honoured(split: bool) -> None:
    tokenizer = _minilm()
    tokenizer.split_special_tokens = split
    text = "[CLS] inside [SEP] the text [MASK]"
    expected = _reference(tokenizer, text, add_special_tokens=False)
    assert encode_batch(tokenizer, [text])[0].ids == expected
    assert (101 in expected) is not split


def test_wrapper_settings_left_on_the_backend_are_reset() -> None:
    """A backend left truncating or padding (a tokenizer.json's, or someone's call) cuts nothing."""
    tokenizer = _minilm()
    text = "word " * 300
    expected = _reference(tokenizer, text)
    tokenizer.backend_tokenizer.enable_truncation(16)
    tokenizer.backend_tokenizer.enable_padding(length=400)
    assert encode_batch(tokenizer, [text], add_special_tokens=True)[0].ids == expected


def test_classes_with_their_own_steps_use_transformers() -> None:
    assert runs_backend_directly(type(_minilm()))
    assert runs_backend_directly(PreTrainedTokenizerFast)
    # NLLB switches its language codes into the template on every call
    assert not runs_backend_directly(NllbTokenizer)

    class OwnCall(PreTrainedTokenizerFast):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    assert not runs_backend_directly(OwnCall)
    assert not runs_backend_directly(BertTokenizerLegacy)


def test_a_slow_tokenizer_goes_through_transformers() -> None:
    slow = BertTokenizerLegacy(vocab_file=str(minilm_path() / "vocab.txt"))
    slow.model_max_length = 1 << 30
    assert backend_of(slow) is None
    model = _handle(slow)
    texts = [t for t in SHORT_TEXTS if t]
    got = encode_texts(model, texts, Truncation(None, "right"))
    assert got == [_reference(slow, text) for text in texts]
    reference = copy.deepcopy(slow)
    reference.truncation_side = "left"
    got = encode_texts(model, texts, Truncation(6, "left"))
    assert got == [reference(t, truncation=True, max_length=6)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def bert(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client("bert") as client:
        yield client


def test_http_prompts_equal_transformers_ids(bert: Any) -> None:
    """/tokenize and /v1/embeddings (a batch, inline and in a worker thread) over HTTP."""
    tokenizer = _minilm()
    texts = [t for t in TEXTS if t.strip() and len(t) < 10_000]
    for text in texts[:6]:
        for add in (True, False):
            body = {"prompt": text, "add_special_tokens": add}
            answer = bert.post("/tokenize", json=body).json()
            assert answer["tokens"] == _reference(tokenizer, text, add_special_tokens=add)
    body = {"input": texts, "truncate_prompt_tokens": 32}
    response = bert.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    expected = [_reference(tokenizer, t, truncation=True, max_length=32) for t in texts]
    assert response.json()["usage"]["prompt_tokens"] == sum(map(len, expected))
    by_ids = bert.post("/v1/embeddings", json={"input": expected}).json()["data"]
    for got, want in zip(response.json()["data"], by_ids, strict=True):
        assert_close(np.asarray(got["embedding"]), np.asarray(want["embedding"]))
