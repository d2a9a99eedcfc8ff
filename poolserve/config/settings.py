"""Server settings: every option is a CLI flag and a POOLSERVE_* environment variable."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from poolserve.types.lora import DEFAULT_MAX_LORA_RANK, LoraServing, parse_lora_module
from poolserve.types.process import CoreMalloc


class Scope(StrEnum):
    """Whom a setting belongs to; marked on each field, read by `scope_of`."""

    SERVER = "server"  # the HTTP server, the processes, logs, auth: one value for every model
    MODEL = "model"  # what a model loads, how its engine schedules, its requests' bounds: a
    # --models-config entry may set its own


# Each field's marks: its scope, and whether it shapes what is computed (a corpus job's
# manifest records those; the rest change how the server runs, never its outputs).
MODEL_OUTPUTS: dict[str, Any] = {"scope": Scope.MODEL.value, "shapes_outputs": True}
MODEL: dict[str, Any] = {"scope": Scope.MODEL.value, "shapes_outputs": False}
SERVER_OUTPUTS: dict[str, Any] = {"scope": Scope.SERVER.value, "shapes_outputs": True}
SERVER: dict[str, Any] = {"scope": Scope.SERVER.value, "shapes_outputs": False}
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")  # what browsers send in Origin
# An --allowed-media-domains entry: a host name, or its subdomains as *.name or .name
MEDIA_HOST = re.compile(r"(\*\.|\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*")


class ServerSettings(BaseSettings):
    """Validated server configuration (CLI flags override the environment)."""

    model_config = SettingsConfigDict(env_prefix="POOLSERVE_", extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        description="Local directory or Hub id; none = the embedded all-MiniLM-L6-v2.",
        json_schema_extra=MODEL_OUTPUTS,
    )
    models: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="More models served beside --model, each under its own name, with the "
        "server's flags (`poolserve serve A B` serves A and B); --models-config sets each "
        "model's own.",
        json_schema_extra=SERVER_OUTPUTS,
    )
    models_config: str | None = Field(
        None,
        description="YAML file of the models to serve, each with its own settings over the "
        "flags' (served names, dtype, max_model_len, pooler config, token budget share, "
        "priority; docs/deploy.md, 'Several models').",
        json_schema_extra=SERVER_OUTPUTS,
    )
    default_model: str | None = Field(
        None,
        description="The model (a served name) of routes without a `model` field (TEI's); "
        "default: the first model.",
        json_schema_extra=SERVER_OUTPUTS,
    )
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Names clients may use in `model`; responses report the first (default: "
        "derived from --model).",
        json_schema_extra=MODEL,
    )
    revision: str | None = Field(
        None,
        description="Hub revision (branch, tag or commit) of a Hub model; ignored for a local "
        "directory.",
        json_schema_extra=MODEL_OUTPUTS,
    )
    auto_truncate: bool = Field(
        False,
        description="Truncate inputs longer than the model's limit instead of refusing them "
        "(400), for requests that do not say how to truncate (TEI's flag).",
        json_schema_extra=MODEL,
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Origins allowed by CORS ('*' for any); none = CORS headers are never sent.",
        json_schema_extra=SERVER,
    )
    allowed_methods: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"],
        description="Methods allowed by CORS.",
        json_schema_extra=SERVER,
    )
    allowed_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"],
        description="Request headers allowed by CORS.",
        json_schema_extra=SERVER,
    )
    allow_credentials: bool = Field(
        False,
        description="Let CORS requests carry credentials (cookies, Authorization).",
        json_schema_extra=SERVER,
    )
    ssl_keyfile: str | None = Field(
        None,
        description="TLS private key file (PEM); with --ssl-certfile the server speaks https.",
        json_schema_extra=SERVER,
    )
    ssl_certfile: str | None = Field(
        None,
        description="TLS certificate chain file (PEM); with --ssl-keyfile.",
        json_schema_extra=SERVER,
    )
    root_path: str = Field(
        "",
        description="Path prefix under which a proxy publishes the server (the proxy strips "
        "it), e.g. /poolserve.",
        json_schema_extra=SERVER,
    )
    host: str = Field("127.0.0.1", description="Address to bind.", json_schema_extra=SERVER)
    port: int = Field(
        default_factory=lambda: int(os.environ.get("AIP_HTTP_PORT", "8000")),
        ge=0,
        le=65535,
        description="Port to bind (Vertex AI's AIP_HTTP_PORT when it sets one, else 8000).",
        json_schema_extra=SERVER,
    )
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Also serve TEI's gRPC API (package tei.v1, with grpc.health.v1 and "
        "reflection) on this port, on --host, in every front-end process; TLS with "
        "--ssl-keyfile/--ssl-certfile (unset: no gRPC).",
        json_schema_extra=SERVER,
    )
    vertex_predict_route: str = Field(
        default_factory=lambda: os.environ.get("AIP_PREDICT_ROUTE", "/vertex"),
        description='Path of Vertex AI\'s prediction route ({"instances": [...]} in, '
        "{\"predictions\": [...]} out, as TEI's /vertex; also served at /vertex): Vertex's "
        "AIP_PREDICT_ROUTE when it sets one.",
        json_schema_extra=SERVER,
    )
    vertex_health_route: str | None = Field(
        default_factory=lambda: os.environ.get("AIP_HEALTH_ROUTE"),
        description="Path of Vertex AI's health check, answered as /ready and open without the "
        "API key: Vertex's AIP_HEALTH_ROUTE when it sets one.",
        json_schema_extra=SERVER,
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the model runs; auto = cuda when available.",
        json_schema_extra=SERVER_OUTPUTS,
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype the model runs in, whatever its checkpoint stores; auto = float32 on "
        "CPU, bfloat16 on CUDA (float16 on GPUs without native bfloat16). A dtype the device "
        "cannot run is refused at startup; heads and pooling always compute in float32.",
        json_schema_extra=MODEL_OUTPUTS,
    )
    quantization: Literal["int8", "fp8"] | None = Field(
        None,
        description="Quantize the layers' linear projections (vLLM's flag): int8 = int8 weights "
        "and per-token int8 activations (CPU and CUDA; qkv too on the CPU in float32, its input "
        "smoothed at load, else it stays in --dtype), fp8 = "
        "fp8 weights and activations on GPUs with fp8 units (compute capability 8.9+, --dtype "
        "bfloat16). Embeddings, norms, attention and heads keep --dtype; refused at startup where "
        "the device cannot run it. Fidelity and speed: docs/models.md, Precision.",
        json_schema_extra=MODEL_OUTPUTS,
    )
    allow_slower_precision: bool = Field(
        False,
        description="Run a --dtype or --quantization that the start-up measurement on the CPU "
        "found below its floor (a half dtype slower than float32; int8 under 1.5x float32's "
        "speed); a warning names the ratio. Without it such a precision is refused at startup. "
        "docs/models.md, Precision.",
        json_schema_extra=MODEL,
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt in tokens (default: the model's limit).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    max_num_batched_tokens: int = Field(
        4096, gt=0, description="Token budget of one forward step.", json_schema_extra=MODEL
    )
    max_num_seqs: int = Field(
        256, gt=0, description="Most sequences in one forward step.", json_schema_extra=MODEL
    )
    max_num_queued_requests: int = Field(
        1024,
        gt=0,
        description="Admission bound on queued + running inputs.",
        json_schema_extra=MODEL,
    )
    max_num_queued_tokens: int = Field(
        262144,
        gt=0,
        description="Admission bound on queued + running prompt tokens.",
        json_schema_extra=MODEL,
    )
    long_prefill_token_threshold: int | None = Field(
        None,
        gt=0,
        description="Cap on one prompt's chunk per step, so long prompts cannot starve short ones.",
        json_schema_extra=MODEL,
    )
    num_kv_blocks: int | None = Field(
        None,
        gt=0,
        description="Paged KV cache blocks for chunked prefill (default: one max_model_len prompt "
        "plus one step's budget).",
        json_schema_extra=MODEL,
    )
    block_size: int = Field(16, gt=0, description="Tokens per KV block.", json_schema_extra=MODEL)
    max_client_batch_size: int = Field(
        2048, gt=0, description="Most inputs in one request.", json_schema_extra=MODEL
    )
    max_input_chars: int | None = Field(
        None,
        gt=0,
        description="Most characters of one text input; a longer one is refused (400) unless it "
        "is truncated, and then only this many from its kept side are tokenized (default: 64 per "
        "token of max_model_len).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    max_request_chars: int | None = Field(
        None,
        gt=0,
        description="Most characters one request may have tokenized, 413 above (default: the "
        "larger of --max-input-chars and 1048576).",
        json_schema_extra=MODEL,
    )
    max_tokenizing_chars: int | None = Field(
        None,
        gt=0,
        description="Admission bound on characters being tokenized at once, 429 above "
        "(default: twice --max-request-chars).",
        json_schema_extra=MODEL,
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Render `messages` with a client's own `chat_template` (vLLM's flag); off, "
        "such requests get 400, since a template is a program run on the server.",
        json_schema_extra=MODEL,
    )
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts whose http(s) image URLs may be fetched (vLLM's flag): example.com "
        "exactly, *.example.com (or .example.com) its subdomains, * any host; none = image URLs "
        "are refused and images come as data URLs or base64. Every redirect is checked again.",
        json_schema_extra=SERVER,
    )
    allow_private_media_addresses: bool = Field(
        False,
        description="Fetch image URLs whose host resolves to a private, loopback, link-local, "
        "multicast or reserved address (off: such URLs are refused before any connection).",
        json_schema_extra=SERVER,
    )
    media_fetch_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds one image URL has to be fetched, connection, redirects and body "
        "together (vLLM's default for images); 408 after.",
        json_schema_extra=SERVER,
    )
    max_image_bytes: int = Field(
        20 * 1024 * 1024,
        gt=0,
        description="Largest encoded image in bytes, a data URL's after base64 decoding or a "
        "fetched body (413 above).",
        json_schema_extra=SERVER,
    )
    max_image_pixels: int = Field(
        50_000_000,
        gt=0,
        description="Most pixels (width x height) of one image, checked from its header before it "
        "is decoded (413 above): a 48-megapixel photo passes, a decompression bomb does not.",
        json_schema_extra=SERVER,
    )
    max_media_redirects: int = Field(
        3,
        ge=0,
        description="Most redirects followed when fetching an image URL (400 above).",
        json_schema_extra=SERVER,
    )
    max_images_per_request: int = Field(
        32,
        gt=0,
        description="Most images in one request (400 above, before any is loaded): each becomes "
        "pixel values held until the request is submitted (CLIP at 224 px: 0.6 MB each).",
        json_schema_extra=SERVER,
    )
    payload_limit: int = Field(
        16 * 1024 * 1024,
        gt=0,
        description="Largest request body in bytes (413 above).",
        json_schema_extra=SERVER,
    )
    api_key: str | None = Field(
        None,
        description="Require `Authorization: Bearer KEY` on inference routes.",
        json_schema_extra=SERVER,
    )
    api_keys_file: str | None = Field(
        None,
        description="API keys of many tenants: a YAML (or .json) file of keys, each with a name "
        "and optional requests_per_second, tokens_per_minute, models and routes; re-read on "
        "SIGHUP. With --api-key too, that key is one more, named default, without limits "
        "(docs/deploy.md, 'Keys for many tenants').",
        json_schema_extra=SERVER,
    )
    batch_dir: str | None = Field(
        None,
        description="Serve OpenAI's Batch API (/v1/files, /v1/batches): uploaded files, batches "
        "and their outputs are kept in this directory and batches resume from it after a "
        "restart (unset: those routes answer 404; docs/api.md, 'Batch API').",
        json_schema_extra=SERVER,
    )
    max_batch_file_bytes: int = Field(
        200 * 1024 * 1024,
        gt=0,
        description="Largest file POST /v1/files takes, in bytes (413 above; OpenAI's 200 MB).",
        json_schema_extra=SERVER,
    )
    max_batch_storage_bytes: int = Field(
        10 * 1024 * 1024 * 1024,
        gt=0,
        description="Bytes all files of --batch-dir may hold together, batch outputs included "
        "(an upload that would pass it is refused; a running batch stops with `failed`).",
        json_schema_extra=SERVER,
    )
    max_batch_requests: int = Field(
        50_000,
        gt=0,
        description="Most request lines in one batch's input file (OpenAI's 50,000).",
        json_schema_extra=SERVER,
    )
    async_scheduling: bool = Field(
        True, description="Plan step N+1 while step N runs.", json_schema_extra=MODEL
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV blocks of prompt prefixes seen before (a rerank's query, an "
        "embedding instruction) for requests that pool only the last token (LAST, yes/no "
        "scoring); causal decoders only: ignored for encoders and bidirectional models. Cached "
        "blocks stay resident until the pool needs them, so on CPU the KV cache grows to "
        "--num-kv-blocks.",
        json_schema_extra=MODEL,
    )
    pooler_config: str | None = Field(
        None,
        description="JSON overrides of pooling defaults, e.g. "
        '{"pooling_type": "MEAN", "normalize": false}, and vLLM\'s model-level keys: '
        '{"enable_chunked_processing": true, "max_embed_len": 32768} (embed inputs longer than '
        'the model, pooled in slices), {"logit_mean": 2.65, "logit_sigma": 1.0} (classifier '
        "logits calibrated before the activation; deprecated logit_bias, logit_scale), "
        '{"pooling_task": "token_embed"} (the model\'s pooling task: /v1/pooling\'s default '
        "and how /score compares, token_embed by MaxSim).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    hf_overrides: str | None = Field(
        None,
        description="JSON object of config.json fields that win over the checkpoint's, as vLLM's "
        'flag: a causal LM reranker is scored through two LM-head rows with {"architectures": '
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}.',
        json_schema_extra=MODEL_OUTPUTS,
    )
    score_template: str | None = Field(
        None,
        description="Jinja score template of /score and /rerank pairs (vLLM's form: `messages` "
        "with the roles query and document; also the variables query, document, instruction), "
        "a file or the template itself; `none`: no template. Default: the checkpoint's chat "
        "template when it names both roles, else the model card's prompt of a known LLM "
        "reranker (Qwen3-Reranker, bge-reranker-v2-gemma, mxbai-rerank-v2; docs/models.md).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    default_prompt_name: str | None = Field(
        None,
        description="Name of the sentence-transformers prompt (config_sentence_transformers.json "
        "`prompts`) prepended to every text a request sends without its own prompt_name or "
        "prompt; overrides the model's default_prompt_name (TEI's flag).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    matryoshka_dimensions: str | None = Field(
        None,
        description="Comma-separated output sizes the model was trained for (Matryoshka), so "
        "requests may ask for `dimensions`; the same as --hf-overrides "
        "'{\"matryoshka_dimensions\": [...]}' (e.g. 1024,512,256,128,64).",
        json_schema_extra=MODEL_OUTPUTS,
    )
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters on the model (vLLM's switch; --lora-modules implies it).",
        json_schema_extra=MODEL,
    )
    lora_modules: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="PEFT LoRA adapters served on the model, each a name clients send as `model` "
        "and its folder (adapter_config.json, adapter_model.safetensors): name=path, or vLLM's "
        'JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'. Listed in /v1/models with '
        "the model as parent; requests of different adapters run in one step.",
        json_schema_extra=MODEL,
    )
    max_loras: int | None = Field(
        None,
        gt=0,
        le=256,
        description="Adapters held at once (default: as many as --lora-modules names, at least 1).",
        json_schema_extra=MODEL,
    )
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK,
        gt=0,
        le=512,
        description="The largest adapter rank served; an adapter above it is refused.",
        json_schema_extra=MODEL,
    )
    api_server_count: int = Field(
        1,
        ge=0,
        le=64,
        description="Front-end processes (HTTP, tokenization, answers) sharing the port, beside "
        "one engine-core process that owns the device (vLLM's flag); 0 runs the engine core in a "
        "thread of one process (tests, small CPU installs).",
        json_schema_extra=SERVER,
    )
    core_malloc: CoreMalloc = Field(
        "glibc",
        description="The engine-core process's allocator: glibc maps and unmaps each large "
        "buffer on every step (on huge pages; memory flat under load); tcmalloc keeps freed "
        "step buffers for the next step, 1.2x to 1.5x faster on large steps but its memory "
        "less bounded (gperftools' library from the system, preloaded: Debian/Ubuntu "
        "libtcmalloc-minimal4, in the image; docs/deploy.md, Memory). Needs "
        "--api-server-count 1 or more.",
        json_schema_extra=SERVER,
    )
    engine_core_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds of silence after which a front end calls the engine core dead (its "
        "requests and all new ones get 503); the core sends a heartbeat twice a second.",
        json_schema_extra=SERVER,
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds in-flight requests get to finish on SIGTERM; then they get 503 and "
        "the process exits (within about 2 s more).",
        json_schema_extra=SERVER,
    )
    drain_delay: float = Field(
        0.0,
        ge=0,
        description="Seconds after SIGTERM during which /ready answers 503 but new work is still "
        "served (each answer closes its connection), so a load balancer's health check takes the "
        "replica out before it refuses anything; set it above the balancer's check interval times "
        "its failure count. Part of --shutdown-timeout, not added to it.",
        json_schema_extra=SERVER,
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a client has to send its request head, and then its body (408 after).",
        json_schema_extra=SERVER,
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="Logging level.",
        json_schema_extra=SERVER,
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log records as text lines, or as one JSON object per line with stable keys "
        "(time, level, logger, message, plus the access log's fields).",
        json_schema_extra=SERVER,
    )
    access_log: bool = Field(
        True,
        description="One log line per HTTP request (logger poolserve.access): method, path, "
        "route, status, latency, prompt tokens, request id; probes and scrapes at debug level.",
        json_schema_extra=SERVER,
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="Export OpenTelemetry traces over OTLP/HTTP (protobuf) to this URL, e.g. "
        "http://collector:4318/v1/traces (a bare host:port URL gets /v1/traces); needs the "
        "`tracing` extra. Off by default.",
        json_schema_extra=SERVER,
    )

    @field_validator(
        "served_model_name",
        "models",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        "allowed_media_domains",
        mode="before",
    )
    @classmethod
    def _name_list(cls, value: object, info: ValidationInfo) -> object:
        """A list from a JSON list, a comma-separated string, or a list of either (flags)."""
        if value is None:
            return None
        items = value if isinstance(value, list | tuple) else [value]
        names = list(dict.fromkeys(name for item in items for name in split_list(item)))
        if not names and info.field_name == "served_model_name":
            raise ValueError("must name at least one model name")
        return names

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_list(cls, value: object) -> object:
        """Each adapter entry as text (name=path or a JSON object), from flags, a JSON list or
        one entry; every one is parsed here, so a bad entry fails at start."""
        if value is None:
            return None
        if isinstance(value, str) and value.strip().startswith("["):
            value = json.loads(value)
        items = value if isinstance(value, list | tuple) else [value]
        texts = [json.dumps(item) if isinstance(item, dict) else item for item in items]
        modules = [parse_lora_module(text) for text in texts]
        names = [m.name for m in modules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"adapter names must differ: {twice} given twice")
        return texts

    @property
    def lora(self) -> LoraServing | None:
        """The model's adapters and their room; None when LoRA is not served."""
        if not self.enable_lora and not self.lora_modules:
            return None
        modules = tuple(parse_lora_module(text) for text in self.lora_modules or ())
        return LoraServing(modules, self.max_loras or max(1, len(modules)), self.max_lora_rank)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """'*' or scheme://host[:port]: a browser's Origin header never has a path or a slash."""
        for origin in origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin like https://app.example:8443")
        return origins

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_hosts(cls, hosts: list[str]) -> list[str]:
        """Host names (ASCII: an IDN in its xn-- form) or IP addresses, lower case, each with an
        optional *. or . before it; or *."""
        checked = []
        for entry in hosts:
            host = entry.lower().rstrip(".").removeprefix("[").removesuffix("]")
            if host != "*" and not MEDIA_HOST.fullmatch(host) and not _is_ip(host):
                raise ValueError(
                    f"{entry!r} is not a host name like images.example.com, *.example.com or *"
                )
            checked.append(host)
        return checked

    @field_validator("vertex_predict_route", "vertex_health_route")
    @classmethod
    def _route(cls, value: str | None) -> str | None:
        """A path starting with /."""
        if value is not None and not value.startswith("/"):
            raise ValueError("must start with /")
        return value

    @field_validator("root_path")
    @classmethod
    def _prefix(cls, value: str) -> str:
        """Empty, or a path starting with / (a trailing / is dropped)."""
        if value and not value.startswith("/"):
            raise ValueError("must start with /")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        """Key and certificate come together, and both files exist."""
        pair = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}
        given = {name: path for name, path in pair.items() if path}
        if len(given) == 1:
            missing = next(name for name in pair if name not in given)
            raise ValueError(f"--{missing.replace('_', '-')} is needed too: TLS takes both files")
        for name, path in given.items():
            if not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no file at {path!r}")
        return self

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """--served-model-name as given (empty: derived from --model)."""
        return tuple(self.served_model_name or ())

    @field_validator("hf_overrides")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        """A JSON object, refused at startup otherwise."""
        if value and not isinstance(json.loads(value), dict):
            raise ValueError("must be a JSON object")
        return value

    @field_validator("matryoshka_dimensions")
    @classmethod
    def _dimension_list(cls, value: str | None) -> str | None:
        """Positive integers separated by commas, refused at startup otherwise."""
        if value is not None and not all(
            p.strip().isdigit() and int(p) > 0 for p in value.split(",")
        ):
            raise ValueError("must be positive integers separated by commas, e.g. 512,256,128")
        return value

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host, refused at startup otherwise."""
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("must be an http:// or https:// URL, e.g. http://localhost:4318")
        return value

    @property
    def hf_overrides_dict(self) -> dict[str, Any] | None:
        """--hf-overrides parsed, with --matryoshka-dimensions folded in (one mechanism)."""
        overrides = json.loads(self.hf_overrides) if self.hf_overrides else None
        if self.matryoshka_dimensions is None:
            return overrides
        dims = [int(p) for p in self.matryoshka_dimensions.split(",")]
        return {**(overrides or {}), "matryoshka_dimensions": dims}


def _is_ip(text: str) -> bool:
    """Whether text is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def split_list(item: object) -> list[str]:
    """One list-valued setting's text: a JSON list (vLLM's form) or comma-separated values."""
    if not isinstance(item, str):
        raise ValueError(f"expected text, got {type(item).__name__}")
    text = item.strip()
    if text.startswith("["):
        parsed = json.loads(text)
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError("a JSON value must be a list of strings")
        return [v.strip() for v in parsed if v.strip()]
    return [part.strip() for part in text.split(",") if part.strip()]


def _marks(name: str) -> dict[str, Any]:
    extra = ServerSettings.model_fields[name].json_schema_extra
    if not isinstance(extra, dict):
        raise TypeError(f"setting {name!r} carries no scope marks")
    return extra


def default_of(name: str) -> Any:
    """A setting's default, for the records built from the settings (one definition)."""
    return ServerSettings.model_fields[name].get_default(call_default_factory=True)


def scope_of(name: str) -> Scope:
    """Whether a setting is the server's or each model's own."""
    return Scope(_marks(name)["scope"])


def shapes_outputs(name: str) -> bool:
    """Whether a setting changes what the model computes (not only how the server runs)."""
    return bool(_marks(name)["shapes_outputs"])


# Settings a --models-config entry may set for itself.
PER_MODEL = frozenset(n for n in ServerSettings.model_fields if scope_of(n) is Scope.MODEL)
# Settings that change how the engine runs, never what it computes: a resumed job may change them.
RUN_ONLY_SETTINGS = frozenset(n for n in ServerSettings.model_fields if not shapes_outputs(n))
