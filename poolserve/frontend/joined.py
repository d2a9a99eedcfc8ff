"""Jina's `late_chunking: true`: a request's inputs joined into one document, one span each.

Jina's Embeddings API concatenates the inputs and embeds them in one pass, answering one
embedding per input, the mean of that input's token states. How it joins and pools, as
jina-ai/late-chunking's tests/test_api.py checks the API against a local run (the test the
Jina API's output must match):

- the separator is one space: `FULL_TEXT = ' '.join(CHUNKS)`;
- each input's tokens are those of its own text, cut at the token where its characters end;
  the space before an input goes with it (a SentencePiece token carries the space before its
  word; a WordPiece tokenizer drops it);
- the special tokens and the task's instruction count too: `_extend_special_tokens(...,
  include_prefix=True, include_sep=True)` gives the first input the leading [CLS] (or <s>) and
  the instruction's tokens, the last one the closing [SEP] (or </s>).

Over the model's length Jina refuses the request unless `truncate` is sent; here late chunking
never truncates (spans.py): the joined document must fit, else 400.
"""

from __future__ import annotations

from poolserve.frontend.spans import LateChunking, Span
from poolserve.frontend.texts import RawInputs
from poolserve.types.errors import InvalidRequestError

SEPARATOR = " "  # jina-ai/late-chunking tests/test_api.py: ' '.join(CHUNKS)


def join_inputs(raw: RawInputs | None) -> tuple[RawInputs | None, LateChunking]:
    """The one document of the inputs and each input's character span of it; anything but
    texts is left as it is (late chunking refuses it, naming the field)."""
    if raw is None or raw.texts is None:
        return raw, LateChunking(joined=True)
    texts = raw.texts
    for index, text in enumerate(texts):
        if not text.strip():  # a blank input has no token of its own to average
            name = "input" if len(texts) == 1 else f"input[{index}]"
            message = f"{name} is blank: late_chunking averages each input's own tokens"
            raise InvalidRequestError(message, "input")
    spans: list[Span] = []
    start = 0  # where the input's own text starts in the document
    for text in texts:
        # the separator before an input is its own: a SentencePiece token starts there
        spans.append((max(start - len(SEPARATOR), 0), start + len(text)))
        start += len(text) + len(SEPARATOR)
    document = SEPARATOR.join(texts)
    return RawInputs((document,), None), LateChunking(spans=(tuple(spans),), joined=True)


def with_ends(spans: tuple[Span, ...], num_tokens: int) -> tuple[Span, ...]:
    """The first span from the prompt's first token (special tokens, instruction), the last to
    its last (the closing special token), as Jina's reference pools them."""
    (_, first_end), *rest = spans
    widened = [(0, first_end), *rest]
    last_start, _ = widened[-1]
    widened[-1] = (last_start, num_tokens)
    return tuple(widened)
