"""--pooler-config: the pooling defaults of a model's requests and vLLM's model-level pooler keys.

Parsed once per served model, where its settings are read (`config/core.py` for the engine
core, the front end's start-up for its handle); both read the same validated record.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    StrictInt,
    ValidationError,
    model_validator,
)

from poolserve.types.params import LogitCalibration
from poolserve.types.tasks import PoolingTask, PoolingType

logger = logging.getLogger(__name__)

# The most tokens --pooler-config's max_embed_len may allow one embedding input (2^24, about
# 64 MiB of int32 ids): a larger value is refused at start, whatever the other flags say.
MAX_EMBED_LEN = 1 << 24


class PoolerDefaults(BaseModel):
    """--pooler-config: defaults applied before a request's own fields, and vLLM's model-level
    pooler settings (chunked processing of long embed inputs, logit calibration)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # vLLM's: the model's one pooling task (a task it serves, checked at load): the task of a
    # /v1/pooling request that names none, and how /score compares (token_embed: MaxSim).
    # vLLM 0.33 spells it pooling_task; its earlier releases, task: both are read.
    task: PoolingTask | None = Field(
        default=None, validation_alias=AliasChoices("pooling_task", "task")
    )
    pooling_type: Literal["CLS", "LAST", "MEAN"] | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: StrictInt | None = None
    step_tag_id: StrictInt | None = None
    returned_token_ids: tuple[StrictInt, ...] | None = None
    # vLLM's: embed inputs longer than the model pooled in slices (frontend/chunked.py), and
    # the most tokens one embed input may have (None: the model's length)
    enable_chunked_processing: bool = False
    max_embed_len: StrictInt | None = Field(default=None, ge=1, le=MAX_EMBED_LEN)
    # vLLM's classifier calibration, `activation((logit - logit_mean) / logit_sigma)`, and its
    # deprecated spellings (logit_bias = logit_mean, logit_scale = 1 / logit_sigma)
    logit_mean: FiniteFloat | None = None
    logit_sigma: FiniteFloat | None = None
    logit_bias: FiniteFloat | None = None
    logit_scale: FiniteFloat | None = None

    @model_validator(mode="after")
    def _calibration(self) -> PoolerDefaults:
        """vLLM's refusals: a new name with its deprecated one, a zero divisor; score, which
        is a route (its pooling follows the task), is no pooling task."""
        if self.task is PoolingTask.SCORE:
            raise ValueError(
                "task: score is a route, not a pooling task: /score and /rerank follow the "
                "model's task (embed, token_embed, or a one-label classify)"
            )
        for old, new in (("logit_bias", "logit_mean"), ("logit_scale", "logit_sigma")):
            if getattr(self, old) is None:
                continue
            if getattr(self, new) is not None:
                raise ValueError(f"Cannot set both `{old}` and `{new}`; use `{new}` only")
            logger.warning("--pooler-config: `%s` is deprecated; use `%s`", old, new)
        if self.logit_scale == 0:
            raise ValueError("logit_scale cannot be 0 (division by zero)")
        if self.logit_scale is not None and not math.isfinite(1.0 / self.logit_scale):
            raise ValueError(
                f"logit_scale {self.logit_scale} is too small: 1 / logit_scale overflows"
            )
        if self.logit_sigma == 0:
            raise ValueError("logit_sigma cannot be 0 (division by zero)")
        return self

    @property
    def embed_pooling(self) -> PoolingType | None:
        """The embed pooling override."""
        return PoolingType[self.pooling_type] if self.pooling_type else None

    @property
    def calibration(self) -> LogitCalibration:
        """logit_mean and logit_sigma, from the deprecated names when those are given."""
        mean = self.logit_mean if self.logit_mean is not None else self.logit_bias
        sigma = self.logit_sigma
        if sigma is None and self.logit_scale is not None:
            sigma = 1.0 / self.logit_scale
        return LogitCalibration(mean, sigma)


def parse_pooler_config(text: str | None) -> PoolerDefaults:
    """Parse the JSON flag (empty means no overrides); raises ValueError naming the problem."""
    if not text:
        return PoolerDefaults()
    try:
        keys = json.loads(text)
    except ValueError:
        keys = None  # pydantic says what is wrong with it
    if isinstance(keys, dict) and {"task", "pooling_task"} <= keys.keys():
        raise ValueError("--pooler-config: send one of pooling_task and task (the same key)")
    try:
        return PoolerDefaults.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(_problem(error["loc"], error["msg"]) for error in exc.errors())
        raise ValueError(f"--pooler-config: {problems}") from None


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """One problem of the flag's JSON, naming its key (none for checks across keys)."""
    message = message.removeprefix("Value error, ")
    return f"{'.'.join(map(str, loc))}: {message}" if loc else message
