"""Each task is declared once (poolserve/types/tasks.py); every other table follows from it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from poolserve.pooling.tasks import TASK_PLANS
from poolserve.types.model_info import HEAD_FIELDS
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import TASKS, HeadKind, PoolingTask, head_tasks
from poolserve.types.validation import FIELD_TASKS

PACKAGE = Path(__file__).resolve().parents[2] / "poolserve"
DECLARATIONS = PACKAGE / "types" / "tasks.py"
ENUMS = {"PoolingTask"}


def _task_members(node: ast.AST) -> int:
    """How many direct elements of a collection literal name a task (PoolingTask.X)."""
    if isinstance(node, ast.Dict):
        elements = [k for k in node.keys if k is not None] + list(node.values)
    elif isinstance(node, ast.Set | ast.List | ast.Tuple):
        elements = list(node.elts)
    else:
        return 0
    return sum(
        isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in ENUMS
        for e in elements
    )


def test_no_list_of_tasks_outside_the_declarations() -> None:
    """A set, list, tuple or dict naming two tasks or more is a second declaration."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == DECLARATIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _task_members(node) >= 2:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_the_scan_finds_a_list_of_tasks() -> None:
    """The check above can fail: it sees the declarations' own tables."""
    tree = ast.parse("x = frozenset({PoolingTask.EMBED, PoolingTask.CLASSIFY})")
    assert any(_task_members(node) >= 2 for node in ast.walk(tree))


def test_declared_fields_are_the_params_fields() -> None:
    # the adapter picks the forward's weights for any task (the engine checks it): no task's field
    optional = {f.name for f in dataclasses.fields(PoolingParams)} - {"task", "adapter"}
    declared = {name for decl in TASKS.values() for name in decl.params}
    assert declared == optional == set(FIELD_TASKS)


@pytest.mark.parametrize("kind", list(HeadKind))
def test_every_served_pair_has_its_plan_and_every_plan_is_served(kind: HeadKind) -> None:
    """What the declarations say a head serves is what pooling knows how to run."""
    served = {
        task
        for named in (None, *PoolingTask)
        for labels in (1, 3)
        for task in head_tasks(kind, labels, named)
    }
    planned = {task for head, task in TASK_PLANS if head is kind}
    assert served == planned


def test_a_one_label_head_serves_more() -> None:
    one = head_tasks(HeadKind.SEQUENCE_CLASSIFIER, num_labels=1)
    three = head_tasks(HeadKind.SEQUENCE_CLASSIFIER, num_labels=3)
    assert three < one and PoolingTask.SCORE in one - three


def test_a_named_task_adds_to_the_head_tasks() -> None:
    """A sequence classifier runs on every token only when --pooler-config names the task."""
    plain = head_tasks(HeadKind.SEQUENCE_CLASSIFIER, num_labels=3)
    named = head_tasks(HeadKind.SEQUENCE_CLASSIFIER, 3, PoolingTask.TOKEN_CLASSIFY)
    assert named - plain == {PoolingTask.TOKEN_CLASSIFY}
    # naming a task the head cannot run adds nothing
    assert head_tasks(HeadKind.SEQUENCE_CLASSIFIER, 3, PoolingTask.TOKEN_EMBED) == plain


def test_every_head_kind_but_none_has_its_module_field() -> None:
    assert set(HEAD_FIELDS) == set(HeadKind) - {HeadKind.NONE}


def test_every_task_is_served_by_some_head() -> None:
    served = {t for kind in HeadKind for t in head_tasks(kind, num_labels=1)}
    assert served == set(PoolingTask)
