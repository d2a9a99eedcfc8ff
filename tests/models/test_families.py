"""Each model family's facts live in its one module of models/families/; the registry assembles.

Every model_type row, encoder tensor layout, MLM head layout and architecture class comes from
exactly one family module, the registry's tables are exactly their union, and no other module of
models/ names a family's model_type or class (the forwards switch on the rows' fields).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from poolserve.models import families, registry
from poolserve.models.families.records import DecoderFamily, EncoderFamily, EncoderLayout

MODELS = Path(registry.__file__).resolve().parent
# The records every family module fills; it declares no family.
SHARED = {"records"}
FAMILY_MODULES: dict[str, ModuleType] = {
    info.name: importlib.import_module(f"{families.__name__}.{info.name}")
    for info in pkgutil.iter_modules(families.__path__)
    if info.name not in SHARED
}


def _declared(table: str) -> list[tuple[str, Any, Any]]:
    """(module, key, value) of every entry the family modules declare in `table`."""
    return [
        (name, key, value)
        for name, module in sorted(FAMILY_MODULES.items())
        for key, value in getattr(module, table, {}).items()
    ]


def _assembled(table: str) -> dict[Any, Any]:
    """The union of the family modules' `table`, each key declared once."""
    declared = _declared(table)
    counts = Counter(key for _, key, _ in declared)
    assert [key for key, n in counts.items() if n > 1] == []
    return {key: value for _, key, value in declared}


def _owner(key: Any, table: str) -> str:
    """The family module that declares `key` in `table`."""
    return next(name for name, k, _ in _declared(table) if k == key)


def test_every_family_module_declares_rows_or_classes() -> None:
    for name, module in FAMILY_MODULES.items():
        assert hasattr(module, "FAMILIES") or hasattr(module, "ARCHITECTURES"), name


def test_the_registry_tables_are_the_families_declarations() -> None:
    rows = _assembled("FAMILIES")
    decoders = {k: v for k, v in rows.items() if isinstance(v, DecoderFamily)}
    encoders = {k: v for k, v in rows.items() if isinstance(v, EncoderFamily)}
    assert len(decoders) + len(encoders) == len(rows)
    assert decoders == registry.DECODER_FAMILIES
    assert encoders == registry.ENCODER_FAMILIES
    assert _assembled("LAYOUTS") == registry.ENCODER_LAYOUTS
    assert _assembled("MASKED_LM") == registry.MASKED_LM_LAYOUTS
    extra = _assembled("ARCHITECTURES")
    assert set(extra).isdisjoint(c for row in rows.values() for c in row.classes)
    assert registry.ARCHITECTURES.keys() - extra.keys() == {
        c for row in rows.values() for c in row.classes
    }
    assert {k: registry.ARCHITECTURES[k] for k in extra} == extra


def test_each_class_belongs_to_one_row() -> None:
    classes = Counter(c for row in _assembled("FAMILIES").values() for c in row.classes)
    assert [c for c, n in classes.items() if n > 1] == []


def test_a_family_module_holds_its_rows_layouts_and_mlm_heads() -> None:
    """A module's MLM heads are its own rows'; every layout its rows use is declared once."""
    for name, module in FAMILY_MODULES.items():
        assert set(getattr(module, "MASKED_LM", {})) <= set(getattr(module, "FAMILIES", {})), name
    # every encoder family has an MLM head; a decoder family one only where it has *ForMaskedLM
    assert registry.ENCODER_FAMILIES.keys() <= registry.MASKED_LM_LAYOUTS.keys()
    assert registry.MASKED_LM_LAYOUTS.keys() - registry.ENCODER_FAMILIES.keys() <= set(
        registry.DECODER_FAMILIES
    )
    assert set(registry.ENCODER_LAYOUTS) == set(EncoderLayout)
    for model_type, row in registry.ENCODER_FAMILIES.items():
        owner = _owner(row.layout, "LAYOUTS")
        # a family reads its own layout, or one it shares with the module that declares it
        assert owner == _owner(model_type, "FAMILIES") or row.layout is EncoderLayout.BERT


def _string_constants(path: Path) -> set[str]:
    """Every string constant of a module (docstrings included)."""
    tree = ast.parse(path.read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


# (module, string) pairs allowed outside the family that owns the string: the layout enum's
# values, which name tensor layouts, not model types.
ALLOWED = {("families/records.py", layout.value) for layout in EncoderLayout}


@pytest.mark.parametrize(
    "path",
    sorted(MODELS.rglob("*.py")),
    ids=lambda p: p.relative_to(MODELS).as_posix(),
)
def test_only_its_family_module_names_a_model_type_or_class(path: Path) -> None:
    rel = path.relative_to(MODELS).as_posix()
    owners = {key: _owner(key, "FAMILIES") for key in _assembled("FAMILIES")}
    owners.update({key: _owner(key, "ARCHITECTURES") for key in _assembled("ARCHITECTURES")})
    named = {
        (rel, s): owner
        for s in _string_constants(path)
        if (owner := owners.get(s)) is not None and rel != f"families/{owner}.py"
    }
    assert {key: owner for key, owner in named.items() if key not in ALLOWED} == {}
