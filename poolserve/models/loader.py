"""load_model(): config, weights, tokenizer, heads -> LoadedModel."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tokenizers.normalizers import Lowercase, Normalizer
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from poolserve.config.model_path import resolve_model_path
from poolserve.models.adapters import unparametrize
from poolserve.models.attention import AttentionBackend, select_attention_backend
from poolserve.models.bge_m3 import load_m3_heads, m3_entry
from poolserve.models.cpu_kernels import CpuKernels, choose_kernels
from poolserve.models.decoder import DecoderModel
from poolserve.models.decoder_config import decoder_head_dim, decoder_is_causal
from poolserve.models.dual_encoder import (
    ARCHITECTURES as DUAL_ARCHITECTURES,
)
from poolserve.models.dual_encoder import (
    DUAL_NAMES,
    DualEncoderModel,
    DualFamily,
    image_inputs,
    text_head,
)
from poolserve.models.encoder import EncoderModel
from poolserve.models.encoder_config import encoder_max_len
from poolserve.models.families.nomic import adopt_remote_nomic_fields
from poolserve.models.families.records import PatchTower, VisionFamily
from poolserve.models.float_kernels import TORCH, pack_linears
from poolserve.models.heads import (
    HeadFactory,
    LMHeadRows,
    build_head_and_factory,
    classifier_pooling,
    head_out_features,
    lm_head_method,
)
from poolserve.models.late_interaction import check_plain_prompts
from poolserve.models.packed import PackedModel
from poolserve.models.paligemma import PaliGemmaModel, paligemma_inline
from poolserve.models.peft import PeftAdapter, ServedAdapters, make_room, read_peft_adapter
from poolserve.models.quantization import INT_MM, check_quantization, quantize_linears
from poolserve.models.registry import (
    ARCHITECTURES,
    DECODER_FAMILIES,
    ENCODER_FAMILIES,
    REMOTE_CONFIGS,
    WRAPPED,
    ArchitectureEntry,
    Backbone,
    supported_architectures,
)
from poolserve.models.sentence_transformers import read_sentence_transformers
from poolserve.models.smoothing import measure_smoothing, smooths
from poolserve.models.spec import LoadedModel, ModelSpec
from poolserve.models.static import find_static, load_static
from poolserve.models.vision_language import (
    TEXT_PREFIXES as VISION_TEXT_PREFIXES,
)
from poolserve.models.vision_language import (
    VisionLanguageModel,
    inline_images,
    retrieval_tokenizer,
    vision_language,
)
from poolserve.models.weights import load_state_dict, strip_prefix
from poolserve.types.errors import (
    LoraAdapterError,
    ModelLoadError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    UnsupportedDtypeError,
)
from poolserve.types.lora import LoraModule, LoraServing
from poolserve.types.model import SentenceTransformersConfig
from poolserve.types.tasks import CLASSIFIER_HEADS, HeadKind
from poolserve.types.vision import InlineImages

logger = logging.getLogger(__name__)

# What `dtype=None` (--dtype auto) runs in, whatever the checkpoint stores: float32 unless named.
DEFAULT_DTYPES = {"cuda": torch.bfloat16}
# A CUDA device without native bfloat16 (before Ampere) runs auto in float16 instead.
CUDA_FALLBACK_DTYPE = torch.float16
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_model(
    model: str | None,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    revision: str | None = None,
    quantization: str | None = None,
    allow_slower_precision: bool = False,
    lora: LoraServing | None = None,
) -> LoadedModel:
    """Loads a checkpoint (local dir, Hub id, or None = all-MiniLM-L6-v2) for packed forwards.

    `hf_overrides` are config.json fields that win over the checkpoint's (vLLM's --hf-overrides);
    `revision` picks the Hub commit, branch or tag of a Hub id; `quantization` (int8, fp8)
    replaces the layers' projection weights (poolserve/models/quantization.py). On the CPU a
    dtype other than float32 and int8 are timed on the model's projections first
    (cpu_kernels.py): one below its floor (slower than float32; int8 under 1.5x) is refused
    unless `allow_slower_precision`.
    """
    # first: a refused dtype or quantization should not wait for a download
    dtype = resolve_dtype(dtype, device)
    check_quantization(quantization, device, dtype)
    path = resolve_model_path(model, revision)
    overrides = dict(hf_overrides or {})
    static = find_static(path)  # model2vec / StaticEmbedding: a token table, no config.json model
    if static is not None:
        if lora is not None:
            raise LoraAdapterError("", "a static embedding model has no projections to adapt")
        return load_static(
            path,
            static,
            placement=(device, dtype),
            overrides=overrides,
            quantization=quantization,
        )
    raw = _read_raw_config(path)
    dual = DUAL_ARCHITECTURES.get(str((raw.get("architectures") or [None])[0]))
    if dual is not None:
        if lora is not None or quantization is not None:
            what = "LoRA adapters" if lora is not None else f"--quantization {quantization}"
            raise ModelLoadError(f"{what}: not supported for a dual encoder ({DUAL_NAMES})")
        if device.type == "cpu" and dtype != torch.float32:
            # its towers' matmuls are not timed at start (cpu_kernels.py): never silently slower
            name = str(dtype).removeprefix("torch.")
            reason = f"a dual encoder ({DUAL_NAMES}) runs float32 on the CPU; use --dtype float32"
            raise UnsupportedDtypeError(name, "cpu", reason)
        return _load_dual(path, raw, overrides, dual, (device, dtype))
    architecture = _check_architecture({**raw, **overrides})
    entry = ARCHITECTURES[architecture]
    if lora is not None and entry.backbone is Backbone.VISION_DECODER:
        # adapters of the decoder alone are untested beside the tower: refused, never guessed
        raise LoraAdapterError("", f"LoRA adapters are not supported for {architecture}")
    config = _load_config(path, raw)
    for key, value in overrides.items():
        setattr(config, key, value)
    entry = m3_entry(path, config, entry)  # bge-m3: its heads' .pt files beside the backbone
    state = unparametrize(load_state_dict(path))  # torch parametrize names (LoRA) made plain
    backbone_state = strip_prefix(state, _backbone_prefix(entry, state))
    placement = (device, dtype)
    packed = _BACKBONES[entry.backbone](
        config, backbone_state, select_attention_backend(device), placement
    )
    full_config = config
    if entry.backbone is Backbone.VISION_DECODER:
        config = _decoder_config(config)
    kernels = CpuKernels(TORCH, None)
    smoothing = None
    if device.type == "cpu":
        kernels = choose_kernels(packed, dtype, quantization, allow_slower_precision)
        if quantization == "int8" and smooths(dtype):
            causal = entry.backbone.is_decoder and decoder_is_causal(config)
            smoothing = measure_smoothing(packed, causal)
    quantized = quantize_linears(
        packed, quantization, device, kernel=kernels.int8_kernel or INT_MM, smoothing=smoothing
    )
    pack_linears(packed, kernels.float_kernel)
    served_lora = None if lora is None else _install_lora(packed, lora, placement)
    tokenizer = _load_tokenizer(path)
    if entry.backbone is Backbone.VISION_DECODER:
        retrieval_tokenizer(full_config, tokenizer)
    head_factory: HeadFactory | None = None  # a labelled head, to build again for an adapter
    if entry.head_kind is HeadKind.BGE_M3:
        head: torch.nn.Module | None = load_m3_heads(path, config, device)
    else:
        rows = _lm_head_rows(entry, config, tokenizer)
        head, head_factory = build_head_and_factory(entry, state, device, config, rows)
    if entry.head_kind is HeadKind.LATE_INTERACTION:
        check_plain_prompts(path)
    st_config = read_sentence_transformers(path, device)
    if st_config is not None and st_config.do_lower_case:
        _lower_case_first(tokenizer)
    logger.info(
        "loaded %s (%s) from %s on %s: stored as %s, runs as %s, quantization %s (%d weights)",
        architecture,
        full_config.model_type,
        path,
        device,
        _stored_dtype(state),
        dtype,
        quantization,
        quantized,
    )
    return LoadedModel(
        path=path,
        spec=_spec(architecture, entry, config, head, dtype, quantization),
        model=packed,
        head=head,
        tokenizer=tokenizer,
        sentence_transformers=st_config,
        lora=served_lora,
        head_factory=head_factory if lora is not None else None,
        inline_images=_inline_images(path, full_config, tokenizer)
        if entry.backbone is Backbone.VISION_DECODER
        else None,
    )


def _load_dual(
    path: Path,
    raw: dict[str, Any],
    overrides: Mapping[str, Any],
    family: DualFamily,
    placement: tuple[torch.device, torch.dtype],
) -> LoadedModel:
    """A CLIP, SigLIP or SigLIP 2 checkpoint: both towers, the text head, the image
    processor's steps."""
    device, dtype = placement
    config = _load_config(path, raw)
    for key, value in overrides.items():
        setattr(config, key, value)
    state = load_state_dict(path)
    head = text_head(family, state, device)
    placed = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    images = image_inputs(path, family, config)
    model = DualEncoderModel(family, config, placed, select_attention_backend(device), images)
    text = config.text_config
    architecture = str(raw["architectures"][0])
    logger.info("loaded %s from %s on %s as %s", architecture, path, device, dtype)
    spec = ModelSpec(
        architecture=architecture,
        family=str(config.model_type),
        is_causal=False,  # whole prompts; CLIP's causal mask is its text tower's own
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(text.num_attention_heads),
        head_dim=int(text.hidden_size) // int(text.num_attention_heads),
        max_model_len=int(text.max_position_embeddings),
        dtype=dtype,
        head_kind=HeadKind.NONE,
        num_labels=None,
        labels=(),
        supports_matryoshka=False,
        matryoshka_dimensions=None,
        pair_separator=True,
    )
    # the pooled text state is the last token's (CLIP's first end-of-text, which its tokenizer
    # puts last; SigLIP's padded last position), then the text head, as get_text_features
    st = SentenceTransformersConfig(pooling_mode="lasttoken", dense=head, normalize=False)
    tokenizer = _load_tokenizer(path)
    if family.pad_texts and getattr(tokenizer, "padding_side", "right") != "right":
        # texts are padded after their tokens, where the pooled last position reads a pad
        raise ModelLoadError(
            f"{architecture}: a tokenizer that pads on the {tokenizer.padding_side} is not "
            "supported (texts are padded on the right, as the family's checkpoints do)"
        )
    return LoadedModel(
        path=path,
        spec=spec,
        model=model,
        head=None,
        tokenizer=tokenizer,
        sentence_transformers=st,
        images=images,
        pad_texts_to=int(text.max_position_embeddings) if family.pad_texts else None,
    )


def _install_lora(
    packed: PackedModel, lora: LoraServing, placement: tuple[torch.device, torch.dtype]
) -> ServedAdapters:
    """Room for --max-loras adapters in every projection; --lora-modules' adapters read."""
    make_room(packed, lora.max_lora_rank, lora.max_loras, placement)
    adapters = tuple((m, read_adapter(m)) for m in lora.modules)
    logger.info(
        "LoRA: room for %d adapters of rank <= %d; registered: %s",
        lora.max_loras,
        lora.max_lora_rank,
        ", ".join(m.name for m in lora.modules) or "none yet",
    )
    return ServedAdapters(lora, adapters)


def read_adapter(module: LoraModule) -> PeftAdapter:
    """The PEFT adapter a LoraModule names, read from its folder (or its Hub id's download)."""
    return read_peft_adapter(module.name, _adapter_path(module))


def _adapter_path(module: LoraModule) -> Path:
    """The adapter's folder: a local one, or a Hub id's download."""
    try:
        return resolve_model_path(module.path, None)
    except (ModelLoadError, OSError) as exc:
        raise LoraAdapterError(module.name, str(exc)) from exc


def resolve_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the backbone runs in (None: the device's default); one it cannot run is refused."""
    if dtype is None:
        dtype = DEFAULT_DTYPES.get(device.type, torch.float32)
        if dtype == torch.bfloat16 and not _native_bf16(device):
            logger.warning("%s has no native bfloat16: running in float16", device)
            dtype = CUDA_FALLBACK_DTYPE
    name = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(name, str(device), "only float32, bfloat16 and float16 run")
    if dtype == torch.bfloat16 and not _native_bf16(device):
        reason = "the GPU has no native bfloat16 support (torch.cuda.is_bf16_supported() is False)"
        raise UnsupportedDtypeError(name, str(device), reason)
    # CUDA runs every kernel in float16 and, where native, bfloat16; CPU coverage of half types
    # depends on the torch build, so a half dtype on the CPU is tried before it is promised (and
    # its speed against float32 is measured at load: cpu_kernels.py).
    if device.type == "cpu" and dtype != torch.float32:
        try:
            _try_cpu_kernels(dtype)
        except (RuntimeError, NotImplementedError) as exc:
            raise UnsupportedDtypeError(name, str(device), str(exc)) from exc
    return dtype


def _native_bf16(device: torch.device) -> bool:
    """True off CUDA (CPU kernels take bfloat16) and on GPUs with bfloat16 in hardware."""
    if device.type != "cuda":
        return True
    # the current device: the service runs on "cuda"; emulated bfloat16 is slow and lacks flash
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _try_cpu_kernels(dtype: torch.dtype) -> None:
    """Runs the CPU kernels the forwards use on a few values; raises where one lacks the dtype."""
    x = torch.ones(1, 2, 4, 8, dtype=dtype)  # [batch, heads, tokens, head_dim]
    F.scaled_dot_product_attention(x, x, x, is_causal=True)
    h = x.reshape(8, 8)  # [tokens, hidden]
    h = F.gelu(F.linear(h, h, h[0]), approximate="tanh") + F.silu(h).softmax(-1)
    F.layer_norm(h, (8,), h[0], h[1])
    F.embedding(torch.zeros(2, dtype=torch.long), h)


def _stored_dtype(state: dict[str, torch.Tensor]) -> str:
    """The dtype of the checkpoint's first floating-point tensor, for the log."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    return str(dtype).removeprefix("torch.")


def _read_raw_config(path: Path) -> dict[str, Any]:
    """config.json as plain JSON, read before transformers sees it."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"malformed config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json is not a JSON object")
    return raw


def _check_architecture(raw: dict[str, Any]) -> str:
    """The supported architecture; remote-code-only checkpoints are refused."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError("config.json names no architecture")
    architecture = str(architectures[0])
    if architecture in ARCHITECTURES:
        if "auto_map" in raw:
            logger.warning(
                "ignoring auto_map of %s: the native implementation runs, never its remote code",
                architecture,
            )
        return architecture
    if "auto_map" in raw:
        raise UnsafeCheckpointError(
            f"{architecture} needs remote code (auto_map); trust_remote_code is refused"
        )
    raise UnsupportedArchitectureError(architecture, supported_architectures())


def _load_config(path: Path, raw: dict[str, Any]) -> PretrainedConfig:
    """The transformers config by model_type, never running remote code (a remote-code
    model_type in REMOTE_CONFIGS is read into its native config)."""
    architectures = raw.get("architectures") or [None]
    remote = REMOTE_CONFIGS.get(str(architectures[0])) or REMOTE_CONFIGS.get(
        str(raw.get("model_type"))
    )
    try:
        if remote is not None:
            return remote(raw)
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load config.json: {exc}") from exc
    return config


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, never running remote code."""
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load tokenizer: {exc}") from exc


def _pair_separator(config: PretrainedConfig) -> bool:
    """vLLM's use_sep_token: the config's (its older name use_pad_token first), else true but for
    a causal LM read through LM-head rows, which vLLM scores on the plain concatenation."""
    for name in ("use_pad_token", "use_sep_token"):
        value = getattr(config, name, None)
        if value is not None:
            return bool(value)
    return lm_head_method(config) is None


def _score_tokens(config: PretrainedConfig) -> tuple[str, ...]:
    """The tokens whose LM-head rows score a causal LM read as a reranker (none: not one)."""
    if lm_head_method(config) is None:
        return ()
    return tuple(str(token) for token in config.classifier_from_token)


def _lm_head_rows(
    entry: ArchitectureEntry, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> LMHeadRows | None:
    """The LM-head rows a causal LM is scored through (`classifier_from_token`), if configured."""
    method = lm_head_method(config)
    if method is None:
        return None
    if not entry.backbone.is_decoder or entry.head_kind is not HeadKind.SEQUENCE_CLASSIFIER:
        raise ModelLoadError(
            f"method {method} reads a causal LM's head: it needs a decoder "
            "*ForSequenceClassification architecture (set `architectures` too)"
        )
    token_ids = []
    for token in config.classifier_from_token:
        # a vocabulary lookup, as vLLM does: the token as it is, never re-tokenized
        token_id = tokenizer.convert_tokens_to_ids(str(token))
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ModelLoadError(f"classifier_from_token {token!r} is not in the vocabulary")
        token_ids.append(token_id)
    return LMHeadRows(method, tuple(token_ids))


def _lower_case_first(tokenizer: PreTrainedTokenizerBase) -> None:
    """do_lower_case as sentence-transformers applies it: a Lowercase normalizer in front."""
    if not tokenizer.is_fast:
        raise ModelLoadError("do_lower_case needs a fast tokenizer (tokenizer.json)")
    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    parts: list[Normalizer] = [] if current is None else [current]
    if isinstance(current, NormalizerSequence):
        # a Sequence iterates over its parts at runtime; the stubs do not say so
        parts = list(cast(Iterable[Normalizer], current))
    # the same test sentence-transformers makes: a Lowercase, alone or in a Sequence
    if not any(isinstance(part, Lowercase) for part in parts):
        backend.normalizer = NormalizerSequence([Lowercase(), *parts])


# where a patch tower's model (PaliGemma) keeps its decoder
_PATCH_TEXT_PREFIXES = tuple(
    prefix
    for wrapped in WRAPPED.values()
    for family in wrapped.families.values()
    if isinstance(family.tower, PatchTower)
    for prefix in family.tower.text_prefixes
)


def _backbone_prefix(entry: ArchitectureEntry, state: dict[str, torch.Tensor]) -> str:
    """The first candidate prefix under which the backbone's embeddings are stored."""
    markers = {
        Backbone.DECODER: ("embed_tokens.weight",),
        Backbone.ENCODER: ("embeddings.word_embeddings.weight", "embeddings.tok_embeddings.weight"),
        Backbone.VISION_DECODER: tuple(
            f"{prefix}embed_tokens.weight"
            for prefix in (*VISION_TEXT_PREFIXES, *_PATCH_TEXT_PREFIXES)
        ),
    }
    for prefix in entry.backbone_prefixes:
        if any(f"{prefix}{marker}" in state for marker in markers[entry.backbone]):
            return prefix
    raise ModelLoadError(
        f"no backbone weights under any of the prefixes {list(entry.backbone_prefixes)}"
    )


def _decoder(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    backend: AttentionBackend,
    placement: tuple[torch.device, torch.dtype],
) -> PackedModel:
    """The packed decoder of a config whose model_type has a row in DECODER_FAMILIES."""
    family = DECODER_FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedArchitectureError(
            f"model_type {config.model_type}", supported_architectures()
        )
    return DecoderModel(config, state, family, backend, placement).eval()


def _encoder(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    backend: AttentionBackend,
    placement: tuple[torch.device, torch.dtype],
) -> PackedModel:
    """The packed encoder of a config whose model_type has a row in ENCODER_FAMILIES."""
    family = ENCODER_FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedArchitectureError(
            f"model_type {config.model_type}", supported_architectures()
        )
    adopt_remote_nomic_fields(config)
    return EncoderModel(config, state, family, backend, placement).eval()


def _decoder_config(config: PretrainedConfig) -> PretrainedConfig:
    """A vision-language model's decoder config, whose sizes, limits and heads are the model's;
    with the whole model's reading of its LM head (tied to the embeddings or not) and its
    reranker fields (--hf-overrides set them on the whole config); a family that attends both
    ways over the whole prompt (ColPali's) marked `is_causal: false`."""
    family, _ = vision_language(config)
    text = config.get_text_config()
    if family.bidirectional:
        text.is_causal = False
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    for key in ("method", "classifier_from_token", "is_original_qwen3_reranker"):
        value = getattr(config, key, None)
        if value is not None:
            setattr(text, key, value)
    return text


def _vision_decoder(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    backend: AttentionBackend,
    placement: tuple[torch.device, torch.dtype],
) -> PackedModel:
    """The packed decoder and vision tower of a Qwen-VL checkpoint (the whole state; a
    wrapping class's model config under its field)."""
    family, model_config = vision_language(config)
    build = _VISION_MODELS[type(family.tower)]
    return build(model_config, state, family, backend, placement).eval()


# the packed model of each kind of vision tower: Qwen-VL's, or a tower of fixed-size images
# whose patches are the image tokens (PaliGemma's)
_VISION_MODELS: dict[type, Callable[..., PackedModel]] = {
    VisionFamily: VisionLanguageModel,
    PatchTower: PaliGemmaModel,
}


def _inline_images(
    path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> InlineImages:
    """How the front ends place images in this model's prompts, by its kind of tower."""
    family, model_config = vision_language(config)
    if isinstance(family.tower, PatchTower):
        architecture = str((config.architectures or [""])[0])
        return paligemma_inline(path, architecture, family, model_config, tokenizer)
    return inline_images(path, config, tokenizer)


_BACKBONES: dict[Backbone, Callable[..., PackedModel]] = {
    Backbone.DECODER: _decoder,
    Backbone.ENCODER: _encoder,
    Backbone.VISION_DECODER: _vision_decoder,
}


def _spec(
    architecture: str,
    entry: ArchitectureEntry,
    config: PretrainedConfig,
    head: torch.nn.Module | None,
    dtype: torch.dtype,
    quantization: str | None,
) -> ModelSpec:
    """The ModelSpec of a loaded checkpoint."""
    decoder = entry.backbone.is_decoder
    num_labels = head_out_features(head, entry.head_kind)
    labels: tuple[str, ...] = ()
    if entry.head_kind in CLASSIFIER_HEADS and num_labels is not None:
        id2label = getattr(config, "id2label", None) or {}
        labels = tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels))
    dims = getattr(config, "matryoshka_dimensions", None)
    matryoshka = tuple(int(d) for d in dims) if dims else None
    return ModelSpec(
        architecture=architecture,
        family=str(config.model_type),
        is_causal=decoder and decoder_is_causal(config),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        ),
        head_dim=decoder_head_dim(config)
        if decoder
        else config.hidden_size // config.num_attention_heads,
        max_model_len=int(config.max_position_embeddings) if decoder else encoder_max_len(config),
        dtype=dtype,
        head_kind=entry.head_kind,
        num_labels=num_labels,
        labels=labels,
        supports_matryoshka=bool(getattr(config, "is_matryoshka", False)) or matryoshka is not None,
        matryoshka_dimensions=matryoshka,
        classifier_pooling=classifier_pooling(entry, config),
        quantization=quantization,
        pair_separator=_pair_separator(config),
        score_tokens=_score_tokens(config),
    )
