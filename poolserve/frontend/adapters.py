"""Which LoRA adapter a text job runs through (jina-embeddings-v3's tasks), and its prompt.

A job names an adapter by `adapter` (Jina's `task` on /v1/embeddings) or by a `prompt_name` that
is one of the model's adapters (sentence-transformers' jina-v3 config names its prompts after the
tasks, and its encode() takes both). Named by `adapter` alone, the model's prompt of the same name
applies too (Jina's encode(task=...) prepends the task's instruction).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if job.adapter is None:
        named = job.prompt_name if job.prompt_name in adapters else None
        return AdapterChoice(named, job.prompt_name)
    if job.adapter not in adapters:
        have = f"one of the model's tasks {list(adapters)}" if adapters else "served: no adapters"
        raise InvalidRequestError(f"task {job.adapter!r} is not {have}", "task")
    prompt_name = job.prompt_name
    if prompt_name is None and job.prompt is None and job.adapter in model.prompts.names:
        prompt_name = job.adapter
    return AdapterChoice(job.adapter, prompt_name)
