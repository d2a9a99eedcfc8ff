"""The one parameters merge: the request's value, else --pooler-config's where the task takes it."""

from __future__ import annotations

import pytest

from poolserve.config.pooler import PoolerDefaults
from poolserve.frontend.jobs import Requested, merge
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

DEFAULTS = PoolerDefaults(normalize=False, use_activation=False, dimensions=16, step_tag_id=7)


def test_unset_fields_take_the_servers_default_where_the_task_takes_them() -> None:
    assert merge(PoolingTask.EMBED, Requested(), DEFAULTS) == PoolingParams(
        PoolingTask.EMBED, dimensions=16, normalize=False
    )
    assert merge(PoolingTask.CLASSIFY, Requested(), DEFAULTS) == PoolingParams(
        PoolingTask.CLASSIFY, use_activation=False
    )
    assert merge(PoolingTask.REWARD, Requested(), DEFAULTS) == PoolingParams(
        PoolingTask.REWARD, step_tag_id=7
    )
    # a task that takes none of them gets none: a server-wide default never breaks a request
    assert merge(PoolingTask.EMBED_SPARSE, Requested(), DEFAULTS) == PoolingParams(
        PoolingTask.EMBED_SPARSE
    )


@pytest.mark.parametrize("value", [False, 0, 1])
def test_a_request_value_wins_even_when_falsy(value: int) -> None:
    requested = Requested(normalize=bool(value), dimensions=value)
    merged = merge(PoolingTask.EMBED, requested, DEFAULTS)
    assert (merged.normalize, merged.dimensions) == (bool(value), value)


def test_a_request_value_the_task_does_not_take_is_kept_for_validation_to_refuse() -> None:
    merged = merge(PoolingTask.CLASSIFY, Requested(normalize=True), PoolerDefaults())
    assert merged.normalize is True
