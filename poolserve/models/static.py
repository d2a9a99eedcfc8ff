"""Static embeddings (model2vec, sentence-transformers StaticEmbedding): a token table, no layers.

The hidden state of a token is its row of the table, so the engine's MEAN pooling and the embed
head's normalize give the text's embedding. Two semantics, chosen by the table's tensor name:
- model2vec (`embeddings`, what `StaticModel.encode` reads): the tokenizer adds no special tokens,
  texts are cut to `max_length` tokens (config.json, 512 when absent), and unknown tokens are
  dropped from the mean (after the cut); per-token `weights` and a vocabulary `mapping` are folded
  into one row per token id at load.
- sentence-transformers (`embedding.weight`, `SentenceTransformer.encode`): an EmbeddingBag mean
  over every token, no special tokens, cut only where tokenizer.json's own truncation says.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from poolserve.models.attention import AttentionMetadata
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.packed import PackedModel
from poolserve.models.sentence_transformers import read_sentence_transformers
from poolserve.models.spec import LoadedModel, ModelSpec
from poolserve.models.weights import SINGLE_FILE, safetensors_files
from poolserve.types.errors import ModelLoadError, UnsupportedQuantizationError
from poolserve.types.model import SentenceTransformersConfig
from poolserve.types.tasks import HeadKind

logger = logging.getLogger(__name__)


# The architecture a static model is served as (model2vec's class name, shown by /info).
STATIC_ARCHITECTURE = "StaticModel"
STATIC_MODULE = "StaticEmbedding"  # the sentence-transformers module class, last part of its type
MODEL2VEC_TABLE = "embeddings"
ST_TABLE = "embedding.weight"
# model2vec's DEFAULT_MAX_LENGTH: what encode() cuts texts to when config.json names no max_length
MODEL2VEC_MAX_LENGTH = 512
# A table has no position limit. A model that never truncates (model2vec's `max_length: null`,
# a StaticEmbedding without tokenizer truncation) is served with this max_model_len: the default
# --max-num-batched-tokens, so it starts with default flags; --hf-overrides '{"max_length": N}'
# sets another (and makes a model2vec model cut there, as encode(max_length=N) does).
UNTRUNCATED_MAX_LEN = 4096
# Table dtypes a model2vec or sentence-transformers checkpoint stores that run as floats exactly
# (model2vec's int8 quantization averages the int8 values themselves).
TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8)
# Files of model2vec variants whose extra parts are not served, and why.
REFUSED_FILES = {
    "pipeline.skops": "a model2vec classifier pipeline (its scikit-learn head is a pickle)",
}


@dataclass(frozen=True)
class StaticFolder:
    """Where a static checkpoint keeps its table and tokenizer, and whose semantics it follows."""

    directory: Path  # holds model.safetensors and tokenizer.json
    model2vec: bool  # model2vec's encode semantics, else sentence-transformers'
    config: dict[str, Any]  # model2vec's config.json ({} for a sentence-transformers table)


def find_static(path: Path) -> StaticFolder | None:
    """The static checkpoint in `path`: modules.json's StaticEmbedding, or a model2vec config."""
    directory = _module_directory(path)
    if directory is None and _is_model2vec_config(_json(path / "config.json")):
        directory = path
    if directory is None:
        return None
    for name, what in REFUSED_FILES.items():
        if (path / name).is_file():
            raise ModelLoadError(f"{name}: {what} is not supported; serve its embedding model")
    names = _tensor_names(directory)
    if ST_TABLE in names:
        return StaticFolder(directory, False, {})
    if MODEL2VEC_TABLE in names:
        return StaticFolder(directory, True, _json(directory / "config.json"))
    raise ModelLoadError(
        f"static embedding checkpoint without an {MODEL2VEC_TABLE!r} or {ST_TABLE!r} tensor "
        f"in {directory.name}/{SINGLE_FILE}"
    )


def _module_directory(path: Path) -> Path | None:
    """The folder of modules.json's first module when it is a StaticEmbedding."""
    modules = _json(path / "modules.json", default=[])
    if not isinstance(modules, list) or not modules or not isinstance(modules[0], dict):
        return None
    first = modules[0]
    if str(first.get("type", "")).rsplit(".", 1)[-1] != STATIC_MODULE:
        return None
    return path / str(first.get("path", ""))


def _is_model2vec_config(config: Any) -> bool:
    """config.json as model2vec's distill writes it (older saves carry no modules.json)."""
    if not isinstance(config, dict):
        return False
    return config.get("model_type") == "model2vec" or config.get("architectures") == ["StaticModel"]


def _json(path: Path, default: Any = None) -> Any:
    """A JSON file's content, `default` when absent; unreadable is a load error naming it."""
    if not path.is_file():
        return {} if default is None else default
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc


def _tensor_names(directory: Path) -> set[str]:
    """Tensor names of the folder's safetensors (pickle-only folders are refused by the lookup)."""
    names: set[str] = set()
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as opened:
                names.update(opened.keys())
        except Exception as exc:  # safetensors raises its own untyped errors for corrupt files
            raise ModelLoadError(f"cannot read {file.name}: {exc}") from exc
    return names


def read_table(folder: StaticFolder) -> torch.Tensor:
    """One float row per token id: model2vec's `mapping` and `weights` folded in. [vocab, dim]"""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder.directory):
        with safe_open(str(file), framework="pt") as opened:
            state.update({key: opened.get_tensor(key) for key in opened.keys()})  # noqa: SIM118
    table = state[MODEL2VEC_TABLE if folder.model2vec else ST_TABLE]
    if table.dim() != 2 or table.dtype not in TABLE_DTYPES:
        raise ModelLoadError(
            f"static embedding table of dtype {str(table.dtype).removeprefix('torch.')} and "
            f"shape {list(table.shape)} is not supported: a 2-D float or int8 table is"
        )
    table = table.to(torch.float32)
    if not folder.model2vec:
        return table
    mapping, weights = state.get("mapping"), state.get("weights")
    if mapping is not None:
        table = table[mapping.long()]  # [vocab, dim]: each token id's cluster row
    if weights is not None:
        table = table * weights.to(torch.float32)[:, None]  # [vocab, dim]
    return table.contiguous()


def static_tokenizer(
    folder: StaticFolder, config: dict[str, Any]
) -> tuple[PreTrainedTokenizerFast, int | None, int | None]:
    """The tokenizer giving the reference's ids, the kept length (None: no cut), the dropped id.

    Special tokens are never added (a text is its own tokens): the post-processor goes. Padding
    and tokenizer.json's own truncation go too; the front end cuts at the returned length
    (`max_length` of `config`, hf_overrides included, wins).
    """
    try:
        backend = Tokenizer.from_file(str(folder.directory / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises untyped errors for missing or malformed files
        raise ModelLoadError(f"cannot load the static model's tokenizer.json: {exc}") from exc
    side = "right"
    if folder.model2vec:
        length = config.get("max_length", MODEL2VEC_MAX_LENGTH)
        unknown = _unknown_id(backend)
    else:
        truncation = backend.truncation
        length = truncation["max_length"] if truncation else None
        length = config.get("max_length", length)
        side = str(truncation["direction"]).lower() if truncation else side
        unknown = None  # an EmbeddingBag averages every token, unknown ones too
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise ModelLoadError(f"max_length must be an integer or null, got {length!r}")
    backend.no_truncation()
    backend.no_padding()
    backend.post_processor = None
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.truncation_side = side
    return tokenizer, length, unknown


def _unknown_id(backend: Tokenizer) -> int | None:
    """The unknown token's id as model2vec finds it (the model's unk_token, or Unigram's unk_id)."""
    model = backend.model
    if hasattr(model, "unk_token"):
        token = model.unk_token
        return None if token is None else backend.token_to_id(token)
    unk_id = json.loads(backend.to_str())["model"].get("unk_id")
    return None if unk_id is None else int(unk_id)


class StaticModel(PackedModel):
    """Hidden states = table rows; model2vec's unknown tokens are left out of the mean.

    Encoders' prompts are scheduled whole, so each sequence of a step is a whole prompt: a
    prompt with unknown tokens has those rows zeroed and the others scaled by
    num_tokens / num_known, which makes the mean over all its tokens the mean over the known ones
    (all unknown: a zero vector, as model2vec gives). Per-token outputs of such a prompt are those
    scaled rows.
    """

    table: torch.Tensor

    def __init__(self, table: torch.Tensor, unknown_id: int | None) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)  # [vocab, dim]
        self.layers = torch.nn.ModuleList()  # no matmuls: the CPU step threads count none
        self.vocab_size = int(table.shape[0])
        self.unknown_id = unknown_id

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,  # [>= num_tokens, dim]
        token_type_ids: torch.Tensor | None = None,  # ignored: a table has no token types
    ) -> torch.Tensor:  # [num_tokens, dim]
        """Looks the rows up (into `out` when given) and drops unknown tokens from the mean."""
        self.check_inputs(input_ids)
        if attn.causal or attn.has_context:
            raise ValueError("static prompts are scheduled whole")
        num_tokens = input_ids.shape[0]
        hidden = torch.index_select(self.table, 0, input_ids) if out is None else out[:num_tokens]
        if out is not None:
            torch.index_select(self.table, 0, input_ids, out=hidden)
        if self.unknown_id is not None:
            known = input_ids != self.unknown_id  # [num_tokens] bool
            if not bool(known.all()):
                hidden.mul_(self._known_weights(known, attn)[:, None].to(hidden.dtype))
        return hidden

    @staticmethod
    def _known_weights(known: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Per token: 0 if unknown, else its prompt's num_tokens / num_known. [num_tokens]"""
        device = known.device
        seq_lens = torch.tensor(attn.seq_lens_q, device=device)  # [num_seqs]
        seq_of = torch.repeat_interleave(
            torch.arange(attn.num_seqs, device=device), seq_lens
        )  # [num_tokens]
        num_known = torch.zeros(attn.num_seqs, device=device).index_add_(
            0, seq_of, known.float()
        )  # [num_seqs]
        scale = seq_lens.float() / num_known.clamp(min=1.0)  # [num_seqs]
        return known.float() * scale[seq_of]  # [num_tokens]


def load_static(
    path: Path,
    folder: StaticFolder,
    *,
    placement: tuple[torch.device, torch.dtype],
    overrides: dict[str, Any],
    quantization: str | None,
) -> LoadedModel:
    """The LoadedModel of a static checkpoint: its table, tokenizer and mean pooling."""
    device, dtype = placement
    if quantization is not None:
        raise UnsupportedQuantizationError(
            quantization, str(device), "a static embedding model has no projections to quantize"
        )
    config = {**folder.config, **overrides}
    tokenizer, length, unknown_id = static_tokenizer(folder, config)
    table = read_table(folder).to(device=device, dtype=dtype)  # [vocab, dim]
    st = read_sentence_transformers(path, device) if (path / "modules.json").is_file() else None
    normalize = bool(config.get("normalize", False)) if folder.model2vec else False
    st_config = replace(
        st or SentenceTransformersConfig(None, None, normalize),
        pooling_mode="mean",  # an EmbeddingBag's mean, model2vec's mean
        max_seq_length=length,
        normalize=normalize or (st is not None and st.normalize),
    )
    vocab_size, dim = (int(n) for n in table.shape)
    logger.info(
        "loaded a static embedding model (%s semantics) from %s on %s: %d tokens x %d, as %s",
        "model2vec" if folder.model2vec else "sentence-transformers",
        path,
        device,
        vocab_size,
        dim,
        dtype,
    )
    spec = ModelSpec(
        architecture=STATIC_ARCHITECTURE,
        family="model2vec" if folder.model2vec else "static_embedding",
        is_causal=False,
        hidden_size=dim,
        vocab_size=vocab_size,
        num_layers=0,
        num_kv_heads=1,
        head_dim=dim,
        max_model_len=length or UNTRUNCATED_MAX_LEN,
        dtype=dtype,
        head_kind=HeadKind.NONE,
        num_labels=None,
        labels=(),
        supports_matryoshka=False,
        matryoshka_dimensions=None,
    )
    model = StaticModel(table, unknown_id).eval()
    return LoadedModel(path, spec, model, None, tokenizer, st_config)
