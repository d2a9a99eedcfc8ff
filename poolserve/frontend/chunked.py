"""vLLM's chunked processing: an embed input longer than the model, pooled in slices, averaged.

With `--pooler-config`'s `enable_chunked_processing`, an embed input is tokenized whole (after
any truncation asked, within `max_embed_len` tokens), cut into consecutive slices of the model's
length (special tokens only where the one tokenization put them, no overlap), each slice pooled
as its own engine prompt by the model's own pooling and head, and the slice outputs averaged
with each slice's token count as its weight (vLLM's aggregation), then L2-normalised when the
request normalises. `max_embed_len` without chunked processing only caps an embed input (vLLM's
older code). The pipeline (`pipeline.py`) calls these around its one submission.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from poolserve.frontend.jobs import Job, TextJob, Truncate
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import InputTooLongError, truncation_for
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

# A character is at most 4 UTF-8 bytes, and byte-level tokenizers give at most a token a byte:
# a text within --max-input-chars has fewer tokens than this many per character.
TOKENS_PER_CHAR = 4
# Below this norm an average has no direction to normalise (torch's F.normalize eps).
NORM_EPS = 1e-12


@dataclass(frozen=True)
class EmbedLimit:
    """How many tokens one embed input may have, and the slices it is pooled in."""

    max_embed_len: int  # the most tokens of one input, after any truncation
    named: bool  # --pooler-config's max_embed_len (else the model's own length)
    slice_len: int | None  # tokens per slice; None: no chunked processing, the cap alone


@dataclass(frozen=True)
class Slicing:
    """Which engine prompts make each input: input i is prompts bounds[i]:bounds[i + 1]."""

    bounds: tuple[int, ...]
    size: int  # tokens per slice (the last slice of an input may have fewer)
    normalize: bool  # the request normalises: the average is L2-normalised too

    def prompts_of(self, item: int) -> slice:
        """The engine prompts of input `item`."""
        return slice(self.bounds[item], self.bounds[item + 1])

    def input_of(self, prompt: int) -> int:
        """The input engine prompt `prompt` is a slice of."""
        return bisect_right(self.bounds, prompt) - 1

    def counts(self) -> list[int]:
        """Slices per input."""
        return [end - start for start, end in zip(self.bounds, self.bounds[1:], strict=False)]

    def join(self, outputs: Sequence[PoolingOutput]) -> list[PoolingOutput]:
        """One output per input from every slice's output, in prompt order."""
        return [self.pool(outputs[self.prompts_of(i)]) for i in range(len(self.bounds) - 1)]

    def pool(self, outputs: Sequence[PoolingOutput]) -> PoolingOutput:
        """One input's slice outputs as one: their mean weighted by token counts (vLLM's)."""
        if len(outputs) == 1:
            return outputs[0]
        weights = np.array([o.num_prompt_tokens for o in outputs], dtype=np.float64)
        stacked = np.stack([o.data.astype(np.float64) for o in outputs])  # [slices, ...]
        mean = np.tensordot(weights, stacked, axes=1) / weights.sum()  # [...]
        if self.normalize:
            mean /= max(float(np.linalg.norm(mean)), NORM_EPS)
        return PoolingOutput(
            request_id=outputs[0].request_id,
            data=mean.astype(np.float32),
            num_prompt_tokens=int(weights.sum()),
            queue_time_s=max(o.queue_time_s for o in outputs),
            inference_time_s=max(o.inference_time_s for o in outputs),
        )


def slice_length(engine_max_len: int, st_max_seq_length: int | None) -> int:
    """The model's prompt length (vLLM's max_model_len, which sentence-transformers' caps)."""
    return engine_max_len if st_max_seq_length is None else min(st_max_seq_length, engine_max_len)


def embed_limit(job: Job, model: ModelHandle, engine_max_len: int) -> EmbedLimit | None:
    """The limit an embed job's inputs run under; None for other jobs, or when unset."""
    defaults = model.defaults
    if not isinstance(job, TextJob) or job.task is not PoolingTask.EMBED:
        return None  # only the embed task chunks; token-level tasks keep the model's limit
    if job.late_chunking is not None:
        return None  # one pass over the whole document, within the model's length
    named = defaults.max_embed_len is not None
    if defaults.enable_chunked_processing:
        size = slice_length(engine_max_len, model.st_max_seq_length)
        return EmbedLimit(defaults.max_embed_len or size, named, size)
    if defaults.max_embed_len is not None:
        return EmbedLimit(defaults.max_embed_len, True, None)
    return None


def tokenizing_model(limit: EmbedLimit, model: ModelHandle, truncate: Truncate) -> ModelHandle:
    """The model as tokenization sees it: with chunked processing, truncation (asked, -1 or
    automatic) cuts at max_embed_len rather than the model's length and sentence-transformers'
    max_seq_length does not cut; an untruncated input is tokenized whole (its characters are
    bounded by --max-input-chars) so that `check_lengths` can name its length."""
    if limit.slice_len is None:
        return model
    capped = replace(model, max_model_len=limit.max_embed_len, st_max_seq_length=None)
    if truncation_for(truncate, capped).keep is not None:
        return capped
    whole = TOKENS_PER_CHAR * model.limits.max_input_chars + len(model.specials)
    return replace(capped, max_model_len=max(whole, limit.max_embed_len))


def check_lengths(limit: EmbedLimit, token_ids: Sequence[Sequence[int]]) -> None:
    """400 with vLLM's message for an input above max_embed_len."""
    for ids in token_ids:
        if len(ids) > limit.max_embed_len:
            what = "maximum embedding input length" if limit.named else "maximum context length"
            raise InputTooLongError(
                f"This model's {what} is {limit.max_embed_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the "
                "length of the input.",
                "input",
            )


def cut(
    token_ids: Sequence[Sequence[int]],
    token_type_ids: Sequence[Sequence[int] | None] | None,
    size: int,
    normalize: bool,
) -> tuple[list[Sequence[int]], list[Sequence[int] | None] | None, Slicing]:
    """Every prompt cut into consecutive slices of `size` tokens (vLLM's chunk_list)."""
    slices: list[Sequence[int]] = []
    types: list[Sequence[int] | None] | None = None if token_type_ids is None else []
    bounds = [0]
    for index, ids in enumerate(token_ids):
        for start in range(0, max(len(ids), 1), size):
            slices.append(ids[start : start + size])
            if types is not None and token_type_ids is not None:
                typed = token_type_ids[index]
                types.append(None if typed is None else typed[start : start + size])
        bounds.append(len(slices))
    return slices, types, Slicing(tuple(bounds), size, normalize)


def slice_params(slicing: Slicing, params: PoolingParams) -> list[tuple[PoolingParams, list[int]]]:
    """The engine prompts grouped by the parameters they run under: a prompt left out of
    pooling (sentence-transformers' include_prompt: false) is skipped in an input's first
    slice only, so it must end there."""
    num_prompts = slicing.bounds[-1]
    if not params.prompt_tokens:
        return [(params, list(range(num_prompts)))]
    if params.prompt_tokens >= slicing.size and any(n > 1 for n in slicing.counts()):
        raise InvalidRequestError(
            f"the prompt has {params.prompt_tokens} tokens, which fill the first slice of "
            f"{slicing.size} tokens of chunked processing; shorten the prompt",
            "prompt",
        )
    firsts = list(slicing.bounds[:-1])
    first = set(firsts)
    rest = [index for index in range(num_prompts) if index not in first]
    groups = [(params, firsts)]
    if rest:
        groups.append((replace(params, prompt_tokens=None), rest))
    return groups
