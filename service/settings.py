"""Server settings: every option is a CLI flag and a POOLSERVE_* environment variable."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what --model none serves


class ServerSettings(BaseSettings):
    """Validated server configuration (CLI flags override the environment)."""

    model_config = SettingsConfigDict(env_prefix="POOLSERVE_", extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="Local directory or Hub id; none = the embedded all-MiniLM-L6-v2."
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in `model` (default: derived from --model)."
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto = cuda when available."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype the model runs in, whatever its checkpoint stores; auto = float32 on "
        "CPU, bfloat16 on CUDA (float16 on GPUs without native bfloat16). A dtype the device "
        "cannot run is refused at startup; heads and pooling always compute in float32.",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt in tokens (default: the model's limit)."
    )
    max_num_batched_tokens: int = Field(4096, gt=0, description="Token budget of one forward step.")
    max_num_seqs: int = Field(256, gt=0, description="Most sequences in one forward step.")
    max_num_queued_requests: int = Field(
        1024, gt=0, description="Admission bound on queued + running inputs."
    )
    max_num_queued_tokens: int = Field(
        262144, gt=0, description="Admission bound on queued + running prompt tokens."
    )
    long_prefill_token_threshold: int | None = Field(
        None,
        gt=0,
        description="Cap on one prompt's chunk per step, so long prompts cannot starve short ones.",
    )
    num_kv_blocks: int | None = Field(
        None,
        gt=0,
        description="Paged KV cache blocks for chunked prefill (default: one max_model_len prompt "
        "plus one step's budget).",
    )
    block_size: int = Field(16, gt=0, description="Tokens per KV block.")
    max_client_batch_size: int = Field(2048, gt=0, description="Most inputs in one request.")
    max_input_chars: int | None = Field(
        None,
        gt=0,
        description="Most characters of one text input; a longer one is refused (400) unless it "
        "is truncated, and then only this many from its kept side are tokenized (default: 64 per "
        "token of max_model_len).",
    )
    max_request_chars: int | None = Field(
        None,
        gt=0,
        description="Most characters one request may have tokenized, 413 above (default: the "
        "larger of --max-input-chars and 1048576).",
    )
    max_tokenizing_chars: int | None = Field(
        None,
        gt=0,
        description="Admission bound on characters being tokenized at once, 429 above "
        "(default: twice --max-request-chars).",
    )
    payload_limit: int = Field(
        16 * 1024 * 1024, gt=0, description="Largest request body in bytes (413 above)."
    )
    api_key: str | None = Field(
        None, description="Require `Authorization: Bearer KEY` on inference routes."
    )
    async_scheduling: bool = Field(True, description="Plan step N+1 while step N runs.")
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV blocks of prompt prefixes seen before (a rerank's query, an "
        "embedding instruction) for requests that pool only the last token (LAST, yes/no "
        "scoring); causal decoders only: ignored for encoders and bidirectional models. Cached "
        "blocks stay resident until the pool needs them, so on CPU the KV cache grows to "
        "--num-kv-blocks.",
    )
    pooler_config: str | None = Field(
        None,
        description="JSON overrides of pooling defaults, e.g. "
        '{"pooling_type": "MEAN", "normalize": false}.',
    )
    hf_overrides: str | None = Field(
        None,
        description="JSON object of config.json fields that win over the checkpoint's, as vLLM's "
        'flag: a causal LM reranker is scored through two LM-head rows with {"architectures": '
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}.',
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds in-flight requests get to finish on SIGTERM; then they get 503 and "
        "the process exits (within about 2 s more).",
    )
    drain_delay: float = Field(
        0.0,
        ge=0,
        description="Seconds after SIGTERM during which /ready answers 503 but new work is still "
        "served (each answer closes its connection), so a load balancer's health check takes the "
        "replica out before it refuses anything; set it above the balancer's check interval times "
        "its failure count. Part of --shutdown-timeout, not added to it.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has to send its request head, and then its body (408 after).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logging level."
    )

    @field_validator("hf_overrides")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        """A JSON object, refused at startup otherwise."""
        if value and not isinstance(json.loads(value), dict):
            raise ValueError("must be a JSON object")
        return value

    @property
    def hf_overrides_dict(self) -> dict[str, Any] | None:
        """--hf-overrides parsed (checked to be a JSON object when the settings were made)."""
        return json.loads(self.hf_overrides) if self.hf_overrides else None
