"""What the routes share: settings, the engine, tokenizers and metrics of one server."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from models.spec import LoadedModel
from pooling.params import PoolingTask
from scheduler.engine import Engine
from service.metrics import ServiceMetrics
from service.pooler_config import PoolerDefaults
from service.settings import ServerSettings

# The task /v1/pooling runs when a request names none: the first the model supports.
DEFAULT_TASK_ORDER = (
    PoolingTask.EMBED,
    PoolingTask.CLASSIFY,
    PoolingTask.REWARD,
    PoolingTask.TOKEN_CLASSIFY,
    PoolingTask.TOKEN_EMBED,
    PoolingTask.EMBED_TOKEN_CLASSIFY,
)


@dataclass(frozen=True)
class ModelHandle:
    """A loaded model as the service sees it."""

    loaded: LoadedModel
    served_name: str
    max_model_len: int
    tokenizers: dict[str, PreTrainedTokenizerBase]  # truncation side -> tokenizer
    defaults: PoolerDefaults

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer for untruncated work."""
        return self.tokenizers["right"]


@dataclass(eq=False)
class ServiceState:
    """Mutable server state; touched only from the event loop."""

    settings: ServerSettings
    metrics: ServiceMetrics
    model: ModelHandle | None = None
    engine: Engine | None = None
    ready: bool = False
    draining: bool = False
    active_requests: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    supported_tasks: tuple[PoolingTask, ...] = field(default_factory=tuple)

    @property
    def default_task(self) -> PoolingTask:
        """The task of a /v1/pooling request that names none."""
        return next(t for t in DEFAULT_TASK_ORDER if t in self.supported_tasks)

    def accepting(self) -> bool:
        """True when inference requests may start."""
        return (
            self.ready
            and not self.draining
            and self.engine is not None
            and self.engine.dead_reason is None
        )
