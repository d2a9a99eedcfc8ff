"""Builds the `ModelCard` of a loaded engine: the facts front ends need, no module, no torch."""

from __future__ import annotations

import dataclasses

from poolserve.engine.loop import Engine
from poolserve.types.card import ModelCard


def card_of(engine: Engine) -> ModelCard:
    """The card of a built engine."""
    loaded = engine.loaded
    spec, st = loaded.spec, loaded.sentence_transformers
    return ModelCard(
        path=loaded.path,
        architecture=spec.architecture,
        vocab_size=spec.vocab_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        labels=spec.labels,
        matryoshka_dimensions=spec.matryoshka_dimensions,
        pair_separator=spec.pair_separator,
        tokenizer=loaded.tokenizer,
        sentence_transformers=None if st is None else dataclasses.replace(st, dense=None),
        num_token_types=loaded.model.num_token_types,
        pooling_info=engine.pooling_info.without_modules(),
        supported_tasks=frozenset(engine.supported_tasks),
        max_model_len=engine.max_model_len,
        scheduler=engine.config,
        device=engine.device.type,
        family=spec.family,
        score_tokens=spec.score_tokens,
        # the checkpoint's own (a request's task); PEFT adapters are reached by model name
        adapters=loaded.model.adapter_names if engine.adapters is None else (),
        lora_modules=() if engine.adapters is None else engine.adapters.modules,
        images=loaded.images,
        pad_texts_to=loaded.pad_texts_to,
        inline_images=loaded.inline_images,
    )
