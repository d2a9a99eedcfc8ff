"""Which LoRA adapter a text job runs through (jina-embeddings-v3's tasks), and its prompt.

A client's `input_type` (Cohere, Voyage, NIM) names the prompt first (input_types.py); it takes
the place of a `prompt_name`, so it reaches jina-v3's adapters too.

A job names an adapter by `adapter` (Jina's `task` on /v1/embeddings) or by a `prompt_name` that
is one of the model's adapters (sentence-transformers' jina-v3 config names its prompts after the
tasks, and its encode() takes both). Named by `adapter` alone, the model's prompt of the same name
applies too (Jina's encode(task=...) prepends the task's instruction).
"""

from __future__ import annotations

from dataclasses import dataclass

from poolserve.frontend.input_types import prompt_for_input_type
from poolserve.frontend.jobs import TextJob
from poolserve.frontend.state import ModelHandle
from poolserve.types.errors import InvalidRequestError


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter a job runs through (None: the base model) and the prompt name it resolves."""

    adapter: str | None
    prompt_name: str | None


def choose_adapter(job: TextJob, model: ModelHandle) -> AdapterChoice:
    """The job's adapter and prompt name; an adapter the model lacks is refused (field `task`)."""
    adapters = model.card.adapters
    prompt_name = _prompt_name(job, model)
    if job.adapter is None:
        named = prompt_name if prompt_name in adapters else None
        return AdapterChoice(named, prompt_name)
    if job.adapter not in adapters:
        have = f"one of the model's tasks {list(adapters)}" if adapters else "served: no adapters"
        raise InvalidRequestError(f"task {job.adapter!r} is not {have}", "task")
    if prompt_name is None and job.prompt is None and job.adapter in model.prompts.names:
        prompt_name = job.adapter
    return AdapterChoice(job.adapter, prompt_name)


def _prompt_name(job: TextJob, model: ModelHandle) -> str | None:
    """The job's prompt name: its own, or the one its input_type means (never both asked)."""
    if job.input_type is None:
        return job.prompt_name
    named = [
        field
        for field, value in (
            ("prompt_name", job.prompt_name),
            ("prompt", job.prompt),
            ("task", job.adapter),
        )
        if value is not None
    ]
    if named:
        raise InvalidRequestError(
            f"input_type and {named[0]} both choose the prompt: send one of them", "input_type"
        )
    return prompt_for_input_type(job.input_type, model.prompts.names)
