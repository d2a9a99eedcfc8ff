"""The one vocabulary models and pooling share without importing each other: plain enums."""

from __future__ import annotations

import enum


class HeadKind(enum.Enum):
    """Which head the checkpoint carries on top of its backbone."""

    NONE = "none"
    SEQUENCE_CLASSIFIER = "sequence_classifier"
    TOKEN_CLASSIFIER = "token_classifier"
    PROCESS_REWARD = "process_reward"
    TOKEN_REWARD = "token_reward"
    MASKED_LM = "masked_lm"  # *ForMaskedLM: transform + vocabulary decoder (sparse embeddings)
    LATE_INTERACTION = "late_interaction"  # ColBERT: a projection of every token (MaxSim)
