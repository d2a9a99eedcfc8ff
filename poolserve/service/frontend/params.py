"""Pooling parameters: a request's own, then `--pooler-config`, then the model's (one merge)."""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt

from poolserve.pooling.params import PoolingParams, PoolingTask, PoolingType
from poolserve.pooling.validation import FIELD_TASKS
from poolserve.service.frontend.jobs import Requested


class PoolerDefaults(BaseModel):
    """Defaults applied before a request's own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: Literal["CLS", "LAST", "MEAN"] | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: StrictInt | None = None
    step_tag_id: StrictInt | None = None
    returned_token_ids: tuple[StrictInt, ...] | None = None

    @property
    def embed_pooling(self) -> PoolingType | None:
        """The embed pooling override."""
        return PoolingType[self.pooling_type] if self.pooling_type else None


def parse_pooler_config(text: str | None) -> PoolerDefaults:
    """Parse the JSON flag (empty means no overrides); raises ValueError naming the problem."""
    if not text:
        return PoolerDefaults()
    return PoolerDefaults.model_validate_json(text)


def merge(task: PoolingTask, requested: Requested, defaults: PoolerDefaults) -> PoolingParams:
    """The request's value where set, else --pooler-config's where the task takes that field.

    Whatever is still None the model decides (its head, its sentence-transformers config).
    """
    merged = {
        name: value
        if value is not None or task not in FIELD_TASKS[name]
        else getattr(defaults, name)
        for name, value in ((f.name, getattr(requested, f.name)) for f in fields(requested))
    }
    return PoolingParams(task=task, **merged)
