"""`--pooler-config`: server-wide defaults for pooling parameters a request leaves unset."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt

from poolserve.pooling.params import PoolingType


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
