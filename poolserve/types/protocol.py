"""What front ends and the engine core say to each other (framed on the socket by wire.py).

Every message is one msgpack header (msgspec, a tagged union) followed by raw buffers: token
ids go to the core as one flat int64 buffer, pooled outputs come back as one buffer each, so
no array is ever turned into Python lists on either side.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import msgspec
import numpy as np

from poolserve.types.errors import StepFailedError
from poolserve.types.images import ImageInputs
from poolserve.types.params import PoolingParams
from poolserve.types.vision import InlineImages, PromptImages

# Errors are rebuilt on the front end as the class the core raised, so the service's error
# table answers exactly as if the engine ran in-process; only the project's own classes.
ERROR_MODULE_ROOT = "poolserve."


class Load(msgspec.Struct, array_like=True, frozen=True):
    """The core's admission counters and health, sent with every reply and heartbeat."""

    queued_requests: int
    queued_tokens: int
    throughput_tokens_per_s: float | None
    dead_reason: str | None  # the engine refuses all work (a device error, a stopped loop)
    draining: bool
    alive: bool  # the engine loop runs (it may run and still refuse work after a device error)


class WireError(msgspec.Struct, array_like=True, frozen=True):
    """An exception by class name, message and attributes."""

    module: str
    qualname: str
    message: str
    state: bytes  # pickled __dict__ of the exception


# ---- front end -> core -----------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front end introduces itself; the core answers with the model card."""


class Submit(msgspec.Struct, tag="submit", array_like=True):
    """Prompts admitted all or none; frames: flat int64 token ids, then flat type ids if typed,
    then the images' float32 pixel values if any prompt is an image.

    Not acknowledged: a refused Submit comes back as a failure of each of its ids in Results.
    """

    ids: list[int]  # the front end's request ids, one per prompt
    lengths: list[int]
    params: PoolingParams
    priority: int
    typed: list[bool]  # per prompt: whether its type ids are in the second frame
    # per prompt: whether it is an image (its ids placeholders, its pixels in the last frame);
    # empty: no image
    images: list[bool] = []
    # per image, in order: its (rows, cols) of patches, for a model whose images differ in size
    # (SigLIP 2's naflex); empty for a model whose images all have one shape
    grids: list[tuple[int, int]] = []
    # a vision-language model's prompts: per prompt, how many images its placeholders stand for
    # (their patches in the last frame, prompt by prompt); empty: no prompt holds an image
    inline: list[int] = []
    # per inline image, in order: its (frames, rows, cols) of patches
    thw: list[tuple[int, int, int]] = []
    # per inline image, in order: its digest (types/vision.py image_digest); empty: none sent
    digests: list[bytes] = []


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """The caller went away: free these requests' work."""

    ids: list[int]


class Query(msgspec.Struct, tag="query", array_like=True):
    """Ask for the engine's gauges and counters (a /metrics scrape)."""

    token: int


class Adapt(msgspec.Struct, tag="adapt", array_like=True):
    """Load a LoRA adapter (`path` set) or unload one (`path` None) at run time."""

    token: int
    name: str
    path: str | None
    base_model_name: str | None = None


# ---- core -> front end -----------------------------------------------------------------------
class Card(msgspec.Struct, tag="card", array_like=True):
    """The model card, pickled (tokenizer and head structure included), and the load."""

    payload: bytes
    load: Load


class OutputHead(msgspec.Struct, array_like=True):
    """One finished request; its data is the next buffer frame."""

    id: int
    num_prompt_tokens: int
    queue_time_s: float
    inference_time_s: float
    dtype: str
    shape: list[int]
    timeline: bytes | None  # pickled RequestTimeline when the engine records timelines


class Results(msgspec.Struct, tag="results", array_like=True):
    """Outputs and failures since the last Results (a refused Submit: each of its ids fails with
    the engine's error); frames: each output's data."""

    outputs: list[OutputHead]
    failures: list[tuple[int, WireError]]
    cancelled: list[int]  # the engine stopped before these finished
    load: Load


class Snapshot(msgspec.Struct, tag="snapshot", array_like=True):
    """The answer to a Query: the pickled EngineSnapshot."""

    token: int
    payload: bytes
    load: Load


class Adapted(msgspec.Struct, tag="adapted", array_like=True):
    """The answer to an Adapt: its error (None: done)."""

    token: int
    error: WireError | None
    load: Load


class Adapters(msgspec.Struct, tag="adapters", array_like=True):
    """The LoRA adapters served now, [name, path, base_model_name] each; sent to every front
    end when they change, so each routes requests by the same names."""

    modules: list[tuple[str, str, str | None]]
    load: Load


class Beat(msgspec.Struct, tag="beat", array_like=True):
    """The core is alive; sent when nothing else was."""

    load: Load


ToCore = Hello | Submit | Cancel | Query | Adapt
ToFrontEnd = Card | Results | Snapshot | Beat | Adapted | Adapters

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_front_end = msgspec.msgpack.Decoder(ToFrontEnd)


def encode(message: msgspec.Struct) -> bytes:
    """A message's header frame."""
    return _encoder.encode(message)


def decode_to_core(frame: bytes | memoryview) -> ToCore:
    """A header frame a front end sent."""
    return _to_core.decode(frame)


def decode_to_front_end(frame: bytes | memoryview) -> ToFrontEnd:
    """A header frame the core sent."""
    return _to_front_end.decode(frame)


def wire_error(exc: BaseException) -> WireError:
    """An exception the front end can rebuild; anything else travels as a failed step."""
    cls = type(exc)
    if not cls.__module__.startswith(ERROR_MODULE_ROOT):
        exc = StepFailedError(f"{cls.__name__}: {exc}")
        cls = StepFailedError
    try:
        state = pickle.dumps(exc.__dict__)
    except Exception:  # an attribute that cannot travel: the message still does
        state = pickle.dumps({})
    return WireError(cls.__module__, cls.__qualname__, str(exc), state)


def rebuild_error(error: WireError) -> Exception:
    """The exception the core raised, as the same class with the same message and attributes."""
    try:
        if not error.module.startswith(ERROR_MODULE_ROOT):
            raise LookupError(error.module)
        cls = getattr(importlib.import_module(error.module), error.qualname)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise LookupError(error.qualname)
        exc = cls.__new__(cls)
        Exception.__init__(exc, error.message)
        exc.__dict__.update(pickle.loads(error.state))
        return exc
    except Exception:  # a class this front end does not know: the message still reaches users
        return StepFailedError(error.message)


def flat_prompts(
    prompts: Sequence[np.ndarray], types: Sequence[np.ndarray | None]
) -> tuple[list[int], list[bool], list[bytes | memoryview]]:
    """Lengths, typed flags and the buffer frames of a Submit."""
    lengths = [len(p) for p in prompts]
    frames: list[bytes | memoryview] = [_joined(prompts)]
    typed = [t is not None for t in types]
    if any(typed):
        frames.append(_joined([t for t in types if t is not None]))
    return lengths, typed, frames


def split_prompts(
    message: Submit, frames: Sequence[bytes | memoryview]
) -> tuple[list[np.ndarray], list[np.ndarray | None] | None]:
    """A Submit's prompts (views of its frame) and per-prompt type ids (None: none typed)."""
    ids = np.frombuffer(frames[0], dtype=np.int64)
    if len(ids) != sum(message.lengths):
        raise ValueError("token frame does not match the prompt lengths")
    prompts = _views(ids, message.lengths)
    if not any(message.typed):
        return prompts, None
    typed_lengths = [n for n, t in zip(message.lengths, message.typed, strict=True) if t]
    types = np.frombuffer(frames[1], dtype=np.int64)
    if len(types) != sum(typed_lengths):
        raise ValueError("token type frame does not match the typed prompts' lengths")
    parts = iter(_views(types, typed_lengths))
    return prompts, [next(parts) if t else None for t in message.typed]


def pixel_frame(
    pixels: Sequence[np.ndarray | None], images: ImageInputs | None
) -> tuple[list[bool], list[tuple[int, int]], list[memoryview]]:
    """A Submit's image flags, naflex grids and its pixel frame (none when no prompt is an
    image)."""
    flags = [p is not None for p in pixels]
    if not any(flags):
        return [], [], []
    present = [p for p in pixels if p is not None]
    grids: list[tuple[int, int]] = []
    if images is not None and images.naflex is not None:
        grids = [(int(p.shape[0]), int(p.shape[1])) for p in present]
    joined = np.concatenate([p.reshape(-1) for p in present])
    return flags, grids, [joined.astype(np.float32, copy=False).data]


def split_pixels(
    message: Submit, frames: Sequence[bytes | memoryview], images: ImageInputs | None
) -> list[np.ndarray | None] | None:
    """Each prompt's pixel values (views of the last frame), None for a text; None: no image.
    A naflex image's grid is checked against the model before its pixels are cut."""
    if not any(message.images):
        if message.grids:
            raise ValueError("image grids without images")
        return None
    if images is None:
        raise ValueError("images sent to a model that takes none")
    if len(message.images) != len(message.lengths):
        raise ValueError("image flags do not match the prompts")
    flat = np.frombuffer(frames[-1], dtype=np.float32)
    count = sum(message.images)
    if images.naflex is None:
        if message.grids:
            raise ValueError("image grids sent to a model whose images have one size")
        shape = images.pixel_shape
        size = int(np.prod(shape))
        if len(flat) != count * size:
            raise ValueError("pixel frame does not match the images")
        parts = iter(flat.reshape(count, *shape))
    else:
        parts = iter(_naflex_views(flat, message.grids, count, images))
    return [next(parts) if is_image else None for is_image in message.images]


def _naflex_views(
    flat: np.ndarray, grids: Sequence[tuple[int, int]], count: int, images: ImageInputs
) -> list[np.ndarray]:
    """Each naflex image's [rows, cols, patch_width] view of the pixel frame."""
    if len(grids) != count:
        raise ValueError("image grids do not match the images")
    for rows, cols in grids:
        images.check_grid(rows, cols)
    width = images.patch_width
    lengths = [rows * cols * width for rows, cols in grids]
    if len(flat) != sum(lengths):
        raise ValueError("pixel frame does not match the image grids")
    views = _views(flat, lengths)
    return [v.reshape(rows, cols, width) for v, (rows, cols) in zip(views, grids, strict=True)]


@dataclass(frozen=True)
class MediaFields:
    """A Submit's inline images: per prompt its count, per image its grid and digest, and the
    patch frame (every image's patches, in order)."""

    counts: list[int]
    grids: list[tuple[int, int, int]]
    digests: list[bytes]
    frames: list[memoryview]


def media_frame(media: Sequence[PromptImages | None]) -> MediaFields:
    """A Submit's inline images (empty when no prompt holds one); digests only when every image
    has its own."""
    counts = [0 if m is None else len(m.grids) for m in media]
    if not any(counts):
        return MediaFields([], [], [], [])
    present = [m for m in media if m is not None]
    grids = [grid for m in present for grid in m.grids]
    digests = [d for m in present for d in m.digests]
    joined = np.concatenate([p.reshape(-1) for m in present for p in m.patches])
    return MediaFields(
        counts,
        grids,
        digests if len(digests) == len(grids) else [],
        [joined.astype(np.float32, copy=False).data],
    )


def split_media(
    message: Submit, frames: Sequence[bytes | memoryview], inline: InlineImages | None
) -> list[PromptImages | None] | None:
    """Each prompt's images (views of the last frame), None for a prompt without; None: no
    prompt holds one. Every grid is checked against the model before its patches are cut."""
    if not any(message.inline):
        if message.thw:
            raise ValueError("image grids without images")
        return None
    if inline is None:
        raise ValueError("images sent to a model that takes none inside its prompts")
    if len(message.inline) != len(message.lengths) or sum(message.inline) != len(message.thw):
        raise ValueError("image counts do not match the prompts or the grids")
    if message.digests and len(message.digests) != len(message.thw):
        raise ValueError("image digests do not match the images")
    for grid in message.thw:
        inline.check_grid(grid)
    width = inline.processing.patch_width
    sizes = [frames_ * rows * cols * width for frames_, rows, cols in message.thw]
    flat = np.frombuffer(frames[-1], dtype=np.float32)
    if len(flat) != sum(sizes):
        raise ValueError("patch frame does not match the image grids")
    views = iter(v.reshape(-1, width) for v in _views(flat, sizes))
    grids = iter(message.thw)
    digests = iter(message.digests)
    media: list[PromptImages | None] = []
    for count in message.inline:
        if count == 0:
            media.append(None)
            continue
        patches = tuple(next(views) for _ in range(count))
        given = tuple(next(digests) for _ in range(count)) if message.digests else ()
        media.append(PromptImages(patches, tuple(next(grids) for _ in range(count)), given))
    return media


def _views(flat: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Consecutive views of `flat`, one per length (np.split costs ~8 us a call in Python)."""
    ends = list(accumulate(lengths))
    return [flat[end - n : end] for end, n in zip(ends, lengths, strict=True)]


def _joined(arrays: Sequence[np.ndarray]) -> bytes | memoryview:
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0], dtype=np.int64).data
    return np.concatenate(arrays).astype(np.int64, copy=False).data
