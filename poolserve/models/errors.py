"""Typed errors of model loading and input validation."""

from __future__ import annotations

from collections.abc import Iterable


class ModelError(Exception):
    """Base class of every error raised by the models package."""


class ModelLoadError(ModelError):
    """A model directory, Hub id or checkpoint file could not be read."""


class UnsafeCheckpointError(ModelError):
    """The checkpoint needs pickle weights or remote code, which are refused."""


class UnsupportedArchitectureError(ModelError):
    """The checkpoint's architecture has no native implementation here."""

    def __init__(self, architecture: str, supported: Iterable[str]) -> None:
        self.architecture = architecture
        self.supported = tuple(sorted(supported))
        super().__init__(
            f"unsupported architecture {architecture!r}; supported: {', '.join(self.supported)}"
        )


class InvalidTokenIdError(ModelError):
    """A token id is negative or not below the vocabulary size."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        self.token_id = token_id
        self.vocab_size = vocab_size
        super().__init__(f"token id {token_id} is out of range [0, {vocab_size})")


class InvalidTokenTypeError(ModelError):
    """Token type ids that do not fit their prompt or the model's token type table."""


class UnsupportedDtypeError(ModelError):
    """The requested dtype cannot run on the device."""

    def __init__(self, dtype: str, device: str, reason: str) -> None:
        self.dtype = dtype
        self.device = device
        super().__init__(f"dtype {dtype} cannot run on {device}: {reason}")


class UnsupportedQuantizationError(ModelError):
    """The requested quantization cannot run on the device, in the dtype or in this install."""

    def __init__(self, quantization: str, device: str, reason: str) -> None:
        self.quantization = quantization
        self.device = device
        super().__init__(f"quantization {quantization} cannot run on {device}: {reason}")


class SlowerPrecisionError(ModelError):
    """A precision that would run slower than float32 on this CPU, or not at all (one line)."""
