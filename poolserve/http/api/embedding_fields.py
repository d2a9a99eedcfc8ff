"""The fields of the other embedding APIs that share OpenAI's path `POST /v1/embeddings`.

Voyage (`voyageai` 0.5: `input_type`, `truncation`, `output_dtype`, `output_dimension`; its
client asks for base64 and decodes it by `output_dtype`), NVIDIA NIM (`input_type` query or
passage, `truncate` NONE, START or END, `embedding_type`) and Jina (`truncate` true or false,
`embedding_type`, `normalized`; `task` is on the request body itself) each name the same few
choices differently. Each is read here into the one request the route runs: a field that
repeats another one's choice must agree with it, or the answer is a 400 naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from poolserve.frontend.jobs import Truncate
from poolserve.frontend.quantize import QUANTIZERS
from poolserve.types.errors import InvalidRequestError

InputType = Literal["query", "document", "passage"]  # Voyage: query, document; NIM: query, passage
OutputDType = Literal["float", "int8", "uint8", "binary", "ubinary"]  # Voyage's output_dtype
EmbeddingType = Literal["float", "base64", "int8", "uint8", "binary", "ubinary"]  # Jina, NIM
NimTruncate = Literal["NONE", "START", "END"]

# the truncation each client's word asks for: NONE, false: refuse over-long inputs;
# END, true: cut the end (keep the start); START: cut the start (keep the end)
TRUNCATIONS: dict[str | bool, Truncate] = {
    "NONE": Truncate(auto=False),
    "END": Truncate(-1, "right"),
    "START": Truncate(-1, "left"),
    True: Truncate(-1, "right"),
    False: Truncate(auto=False),
}
# NIM's OpenAI-compatible spelling of input_type, for clients that cannot send the field: the
# served name with "-query" or "-passage" appended (NIM's docs: NV-Embed-QA-query)
NIM_MODEL_SUFFIXES: dict[str, str] = {"-query": "query", "-passage": "passage"}
# the numpy dtype each quantized precision travels as (base64 bytes, vLLM's binary formats)
WIRE_DTYPES = {"int8": "int8", "uint8": "uint8", "binary": "int8", "ubinary": "uint8"}
assert set(WIRE_DTYPES) == set(QUANTIZERS)
T = TypeVar("T")


@dataclass(frozen=True)
class OutputForm:
    """How the embeddings are answered: their precision and how they travel."""

    precision: str  # float, or a quantized type of frontend/quantize.py
    encoding_format: str  # float (JSON numbers), base64, or vLLM's bytes formats
    embed_dtype: str  # the dtype of the base64 or binary bytes


class ClientEmbeddingFields(BaseModel):
    """Voyage's, NIM's and Jina's fields on /v1/embeddings (see the module's docstring)."""

    # no `extra` of its own: the request body mixing this in keeps its unknown-field policy
    model_config = ConfigDict(frozen=True)

    input_type: InputType | None = Field(
        default=None,
        description="query, or document (Voyage) / passage (NIM): selects the model's query or "
        "document prompt; 400 when the model has prompts but none for it.",
    )
    truncate: NimTruncate | StrictBool | None = Field(
        default=None,
        description="NIM: NONE refuses over-long inputs, START cuts their start, END their end; "
        "Jina: true cuts the end, false refuses.",
    )
    truncation: StrictBool | None = Field(
        default=None, description="Voyage: true cuts over-long inputs' end, false refuses them."
    )
    output_dtype: OutputDType | None = Field(
        default=None,
        description="Voyage: float, or int8/uint8/binary/ubinary quantized as "
        "sentence-transformers' quantize_embeddings (8-bit over [-1, 1] of the unit vector; "
        "binary packs sign bits).",
    )
    embedding_type: EmbeddingType | None = Field(
        default=None,
        description="Jina, NIM: as output_dtype; base64 is float32 in base64.",
    )
    output_dimension: StrictInt | None = Field(
        default=None, description="Voyage's name for dimensions."
    )
    normalized: StrictBool | None = Field(default=None, description="Jina's name for normalize.")

    def client_truncate(self, vllm_tokens: int | None) -> Truncate | None:
        """The truncation `truncate` or `truncation` asks for (None: neither is sent)."""
        given = [(name, value) for name, value in self._truncations() if value is not None]
        if not given:
            return None
        if len(given) > 1 or vllm_tokens is not None:
            other = given[1][0] if len(given) > 1 else "truncate_prompt_tokens"
            raise InvalidRequestError(
                f"{given[0][0]} and {other} both choose truncation: send one of them", other
            )
        return TRUNCATIONS[given[0][1]]

    def _truncations(self) -> tuple[tuple[str, str | bool | None], ...]:
        return (("truncate", self.truncate), ("truncation", self.truncation))

    def output_form(self, encoding_format: str, embed_dtype: str, explicit: set[str]) -> OutputForm:
        """The precision and encoding asked by output_dtype or embedding_type, with vLLM's
        encoding_format and embed_dtype (`explicit`: the fields the body set)."""
        kinds = {name: getattr(self, name) for name in ("output_dtype", "embedding_type")}
        asked = {name: kind for name, kind in kinds.items() if kind is not None}
        if len(set(asked.values())) > 1:
            raise InvalidRequestError(
                "output_dtype and embedding_type disagree: send one of them", "embedding_type"
            )
        kind = next(iter(asked.values()), "float")
        field = next(iter(asked), "output_dtype")
        if kind == "base64":  # Jina's float32 as base64
            if "encoding_format" in explicit and encoding_format != "base64":
                raise InvalidRequestError(
                    f"embedding_type base64 and encoding_format {encoding_format} disagree",
                    "encoding_format",
                )
            return OutputForm("float", "base64", embed_dtype)
        if kind == "float":
            return OutputForm("float", encoding_format, embed_dtype)
        if "embed_dtype" in explicit and embed_dtype != "float32":
            raise InvalidRequestError(
                f"{field} {kind} and embed_dtype {embed_dtype} both choose the output's type: "
                "send one of them",
                "embed_dtype",
            )
        if encoding_format not in ("float", "base64"):
            raise InvalidRequestError(
                f"{field} {kind} is answered as JSON numbers or base64, not {encoding_format}",
                "encoding_format",
            )
        return OutputForm(kind, encoding_format, WIRE_DTYPES[kind])


def agreed(first: tuple[str, T | None], second: tuple[str, T | None]) -> T | None:
    """One value under two names (e.g. dimensions and output_dimension): equal when both given."""
    (name, value), (other, other_value) = first, second
    if value is not None and other_value is not None and value != other_value:
        raise InvalidRequestError(f"{name} and {other} disagree: send one of them", other)
    return value if value is not None else other_value


def nim_model_suffix(
    model: str | None, served: Callable[[str], bool]
) -> tuple[str | None, str | None]:
    """(the model's name, the input_type its NIM suffix says): a name served as it is keeps it."""
    if model is None or served(model):
        return model, None
    for suffix, input_type in NIM_MODEL_SUFFIXES.items():
        stem = model.removesuffix(suffix)
        if stem != model and served(stem):
            return stem, input_type
    return model, None
