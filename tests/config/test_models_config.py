"""Several models: the models named by the flags or the models file, each with its settings,
and every mistake in them refused at start with a message naming the model and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolserve.config.flags import parse_settings
from poolserve.config.models_file import ModelsConfigError, served_models
from poolserve.config.settings import ServerSettings


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return str(path)


def test_models_as_arguments_share_the_flags(tmp_path: Path) -> None:
    embedder, reranker = tmp_path / "embedder", tmp_path / "reranker"
    embedder.mkdir(), reranker.mkdir()
    settings = parse_settings(["serve", str(embedder), str(reranker), "--dtype", "float32"])
    assert (settings.model, settings.models) == (str(embedder), [str(reranker)])
    served = served_models(settings)
    assert [m.name for m in served.models] == ["embedder", "reranker"]  # folder names, no paths
    assert all(m.settings.dtype == "float32" for m in served.models)
    assert served.default.name == "embedder"


def test_the_file_gives_each_model_its_own_settings(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
default_model: ranker
models:
  - model: org/embedder
    served_model_name: [embedder, emb]
    pooler_config: {normalize: false}
    max_model_len: 128
  - model: org/reranker
    served_model_name: ranker
    token_budget_share: 0.25
    priority: -1
    gpu_memory_fraction: 0.4
""",
    )
    settings = ServerSettings(models_config=path, max_num_batched_tokens=4096, dtype="bfloat16")
    served = served_models(settings)
    first, second = served.models
    assert first.served_names == ("embedder", "emb") and first.name == "embedder"
    assert json.loads(first.settings.pooler_config or "") == {"normalize": False}
    assert first.settings.max_model_len == 128 and second.settings.max_model_len is None
    assert first.settings.dtype == second.settings.dtype == "bfloat16"  # the flags' default
    assert second.settings.max_num_batched_tokens == 1024
    assert (second.priority, second.gpu_memory_fraction) == (-1, 0.4)
    assert served.default is second


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models:\n  - model: a\n    colour: red\n", "'colour' is not a setting"),
        ("models:\n  - model: a\n    port: 9000\n", "'port' is a server-wide setting"),
        ("models:\n  - model: a\n    dtype: float8\n", "models[0] (a): dtype"),
        ("models:\n  - model: a\n    max_model_len: -3\n", "max_model_len"),
        ("models:\n  - model: a\n    token_budget_share: 1.5\n", "token_budget_share"),
        ("models: []\n", "models"),
        ("modles:\n  - model: a\n", "modles"),
        ("models: [unclosed\n", "not YAML"),
        (
            "models:\n  - model: a\n    served_model_name: x\n  - model: b\n"
            "    served_model_name: [y, x]\n",
            "two models are served as 'x'",
        ),
        ("models:\n  - model: a\n  - model: a\n", "two models are served as 'a'"),
        (
            "models:\n  - model: a\n    gpu_memory_fraction: 0.7\n  - model: b\n"
            "    gpu_memory_fraction: 0.5\n",
            "add up to 1.2",
        ),
        ("default_model: c\nmodels:\n  - model: a\n  - model: b\n", "'c' is none of"),
    ],
)
def test_mistakes_are_refused_naming_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ModelsConfigError) as exc:
        served_models(ServerSettings(models_config=_file(tmp_path, text)))
    assert message in str(exc.value)


def test_arguments_and_a_file_together_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, "models:\n  - model: a\n")
    with pytest.raises(ModelsConfigError, match="not both"):
        served_models(ServerSettings(model="x", models=["y"], models_config=path))
    with pytest.raises(ModelsConfigError, match="not both"):  # --model alone, too
        served_models(ServerSettings(model="x", models_config=path))


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelsConfigError, match="cannot read"):
        served_models(ServerSettings(models_config=str(tmp_path / "missing.yaml")))


def test_models_twice_on_the_command_line_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(["serve", "a", "b", "--models", "c"])
    assert exc.value.code == 2


def test_name_equals_model_names_each_model(tmp_path: Path) -> None:
    # two folders with one basename: NAME= tells them apart, as vLLM's --served-model-name
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    first.mkdir(parents=True), second.mkdir(parents=True)
    settings = parse_settings(["serve", f"small={first}", f"large={second}", "org/ranker"])
    served = served_models(settings)
    assert [m.name for m in served.models] == ["small", "large", "org/ranker"]
    assert [m.settings.model for m in served.models] == [str(first), str(second), "org/ranker"]
    clash = parse_settings(["serve", str(first), str(second)])
    with pytest.raises(ModelsConfigError, match="two models are served as 'model'"):
        served_models(clash)


def test_a_folder_with_an_equals_sign_is_a_folder(tmp_path: Path) -> None:
    odd = tmp_path / "lr=3e-5"
    odd.mkdir()
    (served,) = served_models(parse_settings(["serve", str(odd)])).models
    assert (served.name, served.settings.model) == ("lr=3e-5", str(odd))


def test_name_equals_is_refused_half_given_or_named_twice() -> None:
    with pytest.raises(ModelsConfigError, match="NAME=MODEL needs both"):
        served_models(parse_settings(["serve", "=org/model"]))
    named_twice = parse_settings(["serve", "mini=org/model", "--served-model-name", "other"])
    with pytest.raises(ModelsConfigError, match="named twice"):
        served_models(named_twice)


def test_a_symlinked_folder_is_named_by_the_link_given(tmp_path: Path) -> None:
    target = tmp_path / "snapshots" / "3f2a9c"
    target.mkdir(parents=True)
    link = tmp_path / "minilm"
    link.symlink_to(target)
    (served,) = served_models(parse_settings(["serve", str(link)])).models
    assert served.name == "minilm"


def test_lora_adapters_per_model_in_the_file_and_on_the_command_line(tmp_path: Path) -> None:
    """--lora-modules in vLLM's two forms, on the command line or per model in the file; a
    model without them serves no LoRA; a name given twice or a bad entry is refused."""
    path = _file(
        tmp_path,
        """
models:
  - model: org/embedder
    lora_modules: [legal=/adapters/legal, {name: med, path: /adapters/med, base_model_name: e}]
    max_loras: 4
  - model: org/reranker
""",
    )
    served = served_models(ServerSettings(models_config=path))
    lora = served.models[0].settings.lora
    assert lora is not None and lora.max_loras == 4 and lora.max_lora_rank == 16
    assert [(m.name, m.path, m.base_model_name) for m in lora.modules] == [
        ("legal", "/adapters/legal", None),
        ("med", "/adapters/med", "e"),
    ]
    assert served.models[1].settings.lora is None
    flags = parse_settings(["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert flags.lora is not None and [m.name for m in flags.lora.modules] == ["a", "b"]
    assert flags.lora.max_loras == 2  # as many as named
    assert parse_settings(["serve", "--enable-lora"]).lora is not None
    for bad in (
        ["a=/x", "a=/y"],
        ["a"],
        ['{"name": "a"}'],
        ['{"name": "a", "path": "/x", "x": 1}'],
    ):
        with pytest.raises(SystemExit):
            parse_settings(["serve", "--lora-modules", *bad])
