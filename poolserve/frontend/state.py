"""What the routes share: settings, the models (each its engine and tokenizer) and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from transformers import PreTrainedTokenizerBase

from poolserve.config.pooler import PoolerDefaults
from poolserve.config.settings import ServerSettings
from poolserve.frontend.client import EngineClient
from poolserve.frontend.jobs import TruncationSide
from poolserve.frontend.media import Budgets
from poolserve.frontend.pair_template import PairLayout
from poolserve.frontend.prompts import Prompts
from poolserve.frontend.score_template import ScoreTemplate
from poolserve.observability.metrics import ServiceMetrics
from poolserve.observability.tracing import NO_TRACING, Tracing
from poolserve.types.admission import CharBudget
from poolserve.types.card import ModelCard
from poolserve.types.lora import LoraModule
from poolserve.types.tasks import DEFAULT_TASK_ORDER, PoolingTask

if TYPE_CHECKING:  # loaded only where the engine core runs in this process
    from poolserve.engine.host import LocalCore

# Default --max-input-chars per token of max_model_len: normal text takes 3-6 characters a token,
# so even text of long words, URLs or indentation fits a max_model_len prompt.
CHARS_PER_TOKEN_LIMIT = 64
# Default --max-request-chars floor: a full batch of sentence-sized inputs fits.
MIN_REQUEST_CHARS = 1 << 20
# Default --max-tokenizing-chars per --max-request-chars: two large requests tokenize at once.
TOKENIZING_REQUESTS = 2


@dataclass(frozen=True)
class TextLimits:
    """Bounds on tokenization work, in characters, checked before any tokenizer runs."""

    max_input_chars: int  # one input; a longer one is refused unless it is truncated
    max_request_chars: int  # what one request may have tokenized (413 above)
    max_tokenizing_chars: int  # what all requests may be tokenizing at once (429 above)

    @classmethod
    def derive(
        cls, settings: ServerSettings, max_model_len: int, max_input_tokens: int | None = None
    ) -> TextLimits:
        """The flags' values, defaults derived from the most tokens one input may have
        (max_model_len, or chunked processing's max_embed_len when larger); inconsistent flags
        refused."""
        # a derived default bends to a smaller explicit bound above it rather than contradict it
        above_request = settings.max_tokenizing_chars
        above_input = settings.max_request_chars or above_request
        by_model = CHARS_PER_TOKEN_LIMIT * max(max_model_len, max_input_tokens or 0)
        per_input = settings.max_input_chars or min(by_model, above_input or by_model)
        by_input = max(per_input, MIN_REQUEST_CHARS)
        per_request = settings.max_request_chars or min(by_input, above_request or by_input)
        at_once = settings.max_tokenizing_chars or TOKENIZING_REQUESTS * per_request
        if not per_input <= per_request <= at_once:
            raise ValueError(
                f"character limits must satisfy --max-input-chars ({per_input}) <= "
                f"--max-request-chars ({per_request}) <= --max-tokenizing-chars ({at_once})"
            )
        return cls(per_input, per_request, at_once)


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens the tokenizer puts around every text."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prefix) + len(self.suffix)


@dataclass(frozen=True)
class ModelHandle:
    """A served model as the service sees it."""

    card: ModelCard  # what the engine core told this front end about the model
    settings: ServerSettings  # the model's own: the server's, its models-file keys over them
    served_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase  # never truncates: the service cuts tokens itself
    defaults: PoolerDefaults
    specials: SpecialTokens
    truncation_side: TruncationSide  # the tokenizer's own; a request may override it
    st_max_seq_length: int | None  # sentence-transformers truncates every prompt to this
    limits: TextLimits
    tokenizing: CharBudget  # characters being tokenized now; touched only from the event loop
    aliases: tuple[str, ...] = ()  # --served-model-name's names after the first
    auto_truncate: bool = False  # --auto-truncate: cut over-long inputs unless a request says not
    prompts: Prompts = field(default_factory=Prompts)  # sentence-transformers prompts
    # tokenizer(a, b)'s layout, probed once at start (None: the tokenizer shows no such template)
    pair_template: PairLayout | None = None
    # how pairs are rendered before tokenizing (an LLM reranker's prompt; None: no template)
    score_template: ScoreTemplate | None = None
    # a LoRA adapter served on the model: its requests run through it (None: the model itself)
    lora: LoraModule | None = None
    parent: str | None = None  # an adapter's base model, by its served name
    base_name: str | None = None  # an adapter's base model by its first served name (metrics')

    def as_adapter(self, lora: LoraModule) -> ModelHandle:
        """This model as a request naming adapter `lora` sees it: answers report its name."""
        parent = lora.base_model_name or self.served_name
        return replace(
            self,
            served_name=lora.name,
            aliases=(),
            lora=lora,
            parent=parent,
            base_name=self.served_name,
        )

    @property
    def model_name(self) -> str:
        """The model a request runs on as metrics, the access log and spans name it: an
        adapter's base model (vLLM counts an adapter's requests under its base)."""
        return self.served_name if self.base_name is None else self.base_name

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter a request runs through (None: the model as it is)."""
        return None if self.lora is None else self.lora.name

    def label_of(self, probs: np.ndarray) -> str:
        """The best class's name: the model's id2label entry, else LABEL_<index>."""
        labels = self.card.labels
        best = int(np.argmax(probs))
        return labels[best] if best < len(labels) else f"LABEL_{best}"

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's `model` may use; the first is the one responses report."""
        return (self.served_name, *self.aliases)

    @property
    def supported_tasks(self) -> tuple[PoolingTask, ...]:
        """The tasks the model serves, in name order."""
        return tuple(sorted(self.card.supported_tasks, key=lambda t: t.value))

    @property
    def default_task(self) -> PoolingTask:
        """The task of a /v1/pooling request that names none: --pooler-config's task, else the
        first the model serves in DEFAULT_TASK_ORDER."""
        chosen = self.card.pooling_info.pooler_task
        if chosen is not None:
            return chosen
        return next(t for t in DEFAULT_TASK_ORDER if t in self.card.supported_tasks)

    @property
    def device(self) -> str:
        """Where the model runs: cpu, cuda."""
        return self.card.device

    @property
    def dtype(self) -> str:
        """The weights' dtype as the flag names it: float32, bfloat16, float16."""
        return self.card.dtype


@dataclass(frozen=True)
class Served:
    """One served model: what the routes know of it, and its engine in the engine core."""

    handle: ModelHandle
    engine: EngineClient

    @property
    def name(self) -> str:
        """The name responses report."""
        return self.handle.served_name


@dataclass(eq=False)
class ServiceState:
    """Mutable server state; touched only from the event loop."""

    settings: ServerSettings
    metrics: ServiceMetrics
    core: LocalCore | None = None  # the engine core when it runs in this process
    core_address: str | None = None  # the engine core process's directory (None: a core here)
    owns_process: bool = False  # a server process of its own (not an app among others, tests)
    ready: bool = False
    start_failure: BaseException | None = None  # why the start failed (said in one line)
    address: str | None = None  # where the server listens (`http://HOST:PORT`), said once ready
    draining: bool = False
    leaving: bool = False  # SIGTERM arrived: /ready is 503, work is served until draining
    active_requests: int = 0
    tracing: Tracing = NO_TRACING
    models: tuple[Served, ...] = ()  # every model, in the order the settings name them
    served: dict[str, Served] = field(default_factory=dict)  # every served name and alias
    default: Served | None = None  # what a request that names no model gets
    _adapter_cache: dict[LoraModule, Served] = field(default_factory=dict)
    # what this process's image loads hold at once (frontend/media.py)
    media_budgets: Budgets = field(default_factory=Budgets.new)

    def serve(self, models: tuple[Served, ...], default: Served) -> None:
        """The models to route to, and the one requests without a `model` get."""
        self.models, self.default = models, default
        self.served = {name: m for m in models for name in m.handle.served_names}
        for served in self.adapters:
            if served.name in self.served:
                raise ValueError(f"LoRA adapter {served.name!r} has a served model's name")

    @property
    def adapters(self) -> tuple[Served, ...]:
        """Every LoRA adapter served now (its engine's card: loads and unloads change it), each
        as a model of its own name."""
        return tuple(
            self._as_served(model, lora)
            for model in self.models
            for lora in model.engine.card.lora_modules
        )

    def _as_served(self, model: Served, lora: LoraModule) -> Served:
        served = self._adapter_cache.get(lora)
        if served is None or served.engine is not model.engine:
            served = Served(model.handle.as_adapter(lora), model.engine)
            self._adapter_cache[lora] = served
        return served

    def find(self, name: str | None) -> Served | None:
        """The model a request's `model` names (the default when it names none): a served name,
        else a LoRA adapter's; None if none."""
        if name is None:
            return self.default
        served = self.served.get(name)
        if served is not None:
            return served
        return next((a for a in self.adapters if a.name == name), None)

    @property
    def model(self) -> ModelHandle | None:
        """The default model (routes without a `model` field use it)."""
        return None if self.default is None else self.default.handle

    @property
    def engine(self) -> EngineClient | None:
        """The default model's engine."""
        return None if self.default is None else self.default.engine

    @property
    def supported_tasks(self) -> tuple[PoolingTask, ...]:
        """The default model's tasks."""
        return () if self.default is None else self.default.handle.supported_tasks

    def accepting(self) -> bool:
        """True when the server reports ready: inference requests may start and will go on to."""
        return (
            self.ready
            and not self.draining
            and not self.leaving
            and bool(self.models)
            and all(m.engine.dead_reason is None for m in self.models)
        )
