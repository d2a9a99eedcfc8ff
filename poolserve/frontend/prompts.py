"""sentence-transformers prompts: a request's `prompt_name` or `prompt` into the text prepended."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from poolserve.types.errors import InvalidRequestError
from poolserve.types.model import SentenceTransformersConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompts:
    """The model's named prompts and the one applied when a request names none."""

    named: tuple[tuple[str, str], ...] = ()
    default_name: str | None = None
    # the Pooling module's include_prompt; false: CLS and MEAN pass over the prompt's tokens
    include_prompt: bool = True

    @classmethod
    def of(cls, st: SentenceTransformersConfig | None, default_name: str | None) -> Prompts:
        """The model's prompts; --default-prompt-name (when set) wins over its default."""
        named = st.prompts if st is not None else ()
        if default_name is not None and default_name not in dict(named):
            raise ValueError(
                f"--default-prompt-name {default_name!r} is not one of the model's prompts "
                f"{sorted(dict(named))} (config_sentence_transformers.json)"
            )
        default = default_name or (st.default_prompt_name if st is not None else None)
        include = st.include_prompt if st is not None else True
        return cls(named, default, include)

    @property
    def names(self) -> tuple[str, ...]:
        """The prompt names a request may use."""
        return tuple(name for name, _ in self.named)

    def resolve(
        self, prompt_name: str | None, prompt: str | None, *, texts: bool = True
    ) -> str | None:
        """The text to prepend, as SentenceTransformer.encode picks it (None: no prompt).

        An explicit `prompt` wins over `prompt_name` (sentence-transformers warns and does the
        same); without either the default prompt applies. Token-id inputs take no prompt.
        """
        if prompt is not None and prompt_name is not None:
            logger.warning("both prompt and prompt_name given: the prompt wins")
        if prompt is None and prompt_name is not None:
            table = dict(self.named)
            if prompt_name not in table:
                raise InvalidRequestError(
                    f"prompt_name {prompt_name!r} is not one of the model's prompts "
                    f"{sorted(table)}",
                    "prompt_name",
                )
            prompt = table[prompt_name]
        explicit = prompt is not None
        if prompt is None and self.default_name is not None:
            prompt = dict(self.named)[self.default_name]
        if not texts:
            if explicit:
                raise InvalidRequestError("a prompt applies to text inputs, not token ids", "input")
            return None
        return prompt or None

    def apply(
        self, texts: Sequence[str], prompt_name: str | None = None, prompt: str | None = None
    ) -> tuple[str, ...]:
        """Each text with the resolved prompt prepended, as SentenceTransformer.encode does."""
        chosen = self.resolve(prompt_name, prompt)
        return prepend(chosen, texts)


def prepend(prompt: str | None, texts: Sequence[str]) -> tuple[str, ...]:
    """Prompt + text, character for character (no separator is added)."""
    if not prompt:
        return tuple(texts)
    return tuple(prompt + text for text in texts)


def prompt_length(
    tokenizer: PreTrainedTokenizerBase, prompt: str, add_special_tokens: bool = True
) -> int:
    """The prompt's tokens as sentence-transformers counts them for include_prompt: false.

    It tokenizes the prompt alone, special tokens included, and drops a trailing special token
    (SEP, EOS): the leading ones (CLS) count as prompt. Without special tokens (a request's
    `add_special_tokens: false`) the prompt's own tokens are all that lead the text.
    """
    # imported here: the service state imports this module, and truncation imports the state
    from poolserve.frontend.truncation import encode_batch

    ids = encode_batch(tokenizer, [prompt], add_special_tokens)[0].ids
    if add_special_tokens and ids and ids[-1] in tokenizer.all_special_ids:
        return len(ids) - 1
    return len(ids)
