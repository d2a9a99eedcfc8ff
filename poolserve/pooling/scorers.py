"""The cross-encoder head: a joint (query, document) prompt's pooled state to one score."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from poolserve.pooling.heads import Head, run_fp32
from poolserve.types.model_info import (
    ScoreActivation,
)
from poolserve.types.params import NO_CALIBRATION, LogitCalibration

# A cross-encoder's default activation over its one logit, as sentence-transformers applies it.
SCORE_ACTIVATIONS: dict[ScoreActivation, Callable[[torch.Tensor], torch.Tensor]] = {
    ScoreActivation.SIGMOID: torch.sigmoid,
    ScoreActivation.IDENTITY: lambda logits: logits,
    ScoreActivation.TANH: torch.tanh,
}


class CrossEncoderHead(Head):
    """The one-label classifier on the pooled pair `[hidden]` -> `[1]`, activated or raw."""

    def __init__(
        self,
        score: nn.Module,
        activation: ScoreActivation | None,
        calibration: LogitCalibration = NO_CALIBRATION,
    ) -> None:
        self.score = score
        self.activation = activation
        self.activate = None if activation is None else SCORE_ACTIVATIONS[activation]
        self.calibration = calibration

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[hidden]` -> `[1]`: the logit calibrated (logit_mean, logit_sigma), then activated."""
        logits = self.calibration(run_fp32(self.score, pooled.float()))  # [1]
        return logits if self.activate is None else self.activate(logits)

    def calibrated(self, calibration: LogitCalibration) -> Head:
        """The same scorer, its logit calibrated before the activation (as vLLM's)."""
        return CrossEncoderHead(self.score, self.activation, calibration)
