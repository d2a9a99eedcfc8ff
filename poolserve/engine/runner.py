"""Turns a plan into a packed forward: persistent buffers, model forward, pooling, D2H."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from poolserve.engine.cpu_threads import StepThreads, matmul_flops_per_token
from poolserve.engine.vision_rows import (
    ChunkImages,
    ImageTower,
    RequestImages,
    chunk_images,
    pending_patches,
)
from poolserve.engine.vision_rows import vision_rows as cut_vision_rows
from poolserve.models.adapters import AdapterSegments
from poolserve.models.attention import build_attention_metadata
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.spec import LoadedModel
from poolserve.pooling.pooler import ChunkInput, PooledChunk, RequestPooler, pool_chunks
from poolserve.types.images import ImageInputs

# An image's embedding, pooled as a whole one-row prompt.
ONE_ROW = ChunkInput(1, (0,), True)


class ImageModel(Protocol):
    """A packed model with an image tower (models/dual_encoder.py)."""

    def embed_images(
        self, pixels: torch.Tensor, grids: tuple[tuple[int, int], ...] = ()
    ) -> torch.Tensor:
        """[num_images, channels, height, width] -> [num_images, dim]; naflex images:
        [num_images, patches, patch_width] and each image's (rows, cols) of patches."""
        ...


@dataclass(frozen=True)
class ChunkWork:
    """One request's chunk in a step, with everything the worker needs to run it."""

    request_id: int
    token_ids: np.ndarray  # [num_tokens] int64, a view of the prompt
    context_len: int  # tokens of this prompt already in the KV cache
    is_last: bool
    block_ids: tuple[int, ...]
    pooler: RequestPooler
    num_kv_tokens: int  # leading tokens whose keys and values the chunk stores in its blocks
    token_type_ids: np.ndarray | None = None  # [num_tokens] int64, a view; None: all type 0
    adapter: int | None = None  # the LoRA adapter (index) its tokens run through; None: none
    # an image's pixel values [channels, height, width] float32 (naflex: [rows, cols, patch]);
    # its token_ids are placeholders counting the image tower's tokens (the step's budget),
    # never run through the text tower
    pixels: np.ndarray | None = None
    # a vision-language prompt's images (their tower rows replace its placeholders' embeddings)
    images: RequestImages | None = None


@dataclass(frozen=True)
class PreparedStep:
    """A step's packed inputs in one slot of the persistent host buffers."""

    step_index: int
    chunks: tuple[ChunkWork, ...]  # the texts' chunks first, then the images'
    num_tokens: int  # every chunk's tokens, an image's counted as its tower's
    slot: int
    has_token_types: bool  # the slot's type buffer holds this step's types
    num_texts: int | None = None  # the leading chunks that run through the token stream (None: all)
    num_text_tokens: int | None = None  # their tokens, packed in the slot (None: num_tokens)
    pixels: torch.Tensor | None = None  # [num_images, channels, height, width] of the images
    grids: tuple[tuple[int, int], ...] = ()  # naflex: each image's (rows, cols) of patches
    vision: tuple[ChunkImages, ...] = ()  # the text chunks' image tokens (vision-language)

    @property
    def texts(self) -> tuple[ChunkWork, ...]:
        """The chunks packed into the token stream."""
        return self.chunks if self.num_texts is None else self.chunks[: self.num_texts]

    @property
    def images(self) -> tuple[ChunkWork, ...]:
        """The images, run through the model's image tower."""
        return () if self.num_texts is None else self.chunks[self.num_texts :]


@dataclass(frozen=True)
class PoolingFailure:
    """One request whose pooling raised in a step: it fails alone, the step's others do not."""

    request_id: int
    error: Exception


@dataclass(frozen=True)
class StepResult:
    """What a step produced: finished outputs (host-bound), pooling failures, forward time."""

    step_index: int
    # (request_id, output) of finished requests: numpy views of host memory, made on the model
    # thread so that the loop's thread never calls into torch for them (on CUDA, valid once
    # copy_done has fired)
    outputs: tuple[tuple[int, np.ndarray], ...]
    failures: tuple[PoolingFailure, ...]  # requests whose pooling raised: each fails alone
    copy_done: torch.cuda.Event | None  # set when the D2H copy has landed (CUDA only)
    num_tokens: int
    duration_s: float
    started_at: float  # time.monotonic() when the forward began


class Runner:
    """Owns the persistent buffers and the KV cache; `execute` runs only on the worker thread."""

    NUM_SLOTS = 2  # ping-pong: step N+1 is prepared while step N's inputs are still in use

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_num_tokens: int,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device,
        async_scheduling: bool,
    ) -> None:
        self.loaded = loaded
        self.device = device
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.is_cuda = device.type == "cuda"
        spec = loaded.spec
        pin = self.is_cuda
        self.host_ids = torch.zeros(
            self.NUM_SLOTS, max_num_tokens, dtype=torch.long, pin_memory=pin
        )
        # positions [slot, token], or M-RoPE's [slot, row, token] (Qwen-VL)
        self.position_rows = loaded.model.position_rows
        rows = () if self.position_rows == 1 else (self.position_rows,)
        self.host_pos = torch.zeros(
            self.NUM_SLOTS, *rows, max_num_tokens, dtype=torch.long, pin_memory=pin
        )
        # Token type ids, filled only for steps where some request has them (BERT pairs).
        self.host_types = torch.zeros(
            self.NUM_SLOTS, max_num_tokens, dtype=torch.long, pin_memory=pin
        )
        self.dev_ids = torch.zeros(self.NUM_SLOTS, max_num_tokens, dtype=torch.long, device=device)
        self.dev_pos = torch.zeros(
            self.NUM_SLOTS, *rows, max_num_tokens, dtype=torch.long, device=device
        )
        self.dev_types = torch.zeros(
            self.NUM_SLOTS, max_num_tokens, dtype=torch.long, device=device
        )
        # The next step overwrites this buffer: outputs viewing it must own their storage first.
        self.hidden = torch.empty(max_num_tokens, spec.hidden_size, dtype=spec.dtype, device=device)
        self.kv_cache = (
            PagedKVCache(spec, num_kv_blocks, block_size, device, spec.dtype)
            if spec.is_causal
            else None
        )
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        # CPU forwards: as many threads as the step has work for (scheduler/cpu_threads.py)
        self.step_threads = (
            None
            if self.is_cuda
            else StepThreads(matmul_flops_per_token(loaded.model), torch.get_num_threads())
        )
        # a vision tower's matmul work per patch (its own layers, outside the decoder's)
        tower = getattr(loaded.model, "visual", None)
        self.patch_flops = 0 if tower is None else matmul_flops_per_token(tower)

    def prepare(self, step_index: int, chunks: Sequence[ChunkWork]) -> PreparedStep:
        """Fill the host slot of this step with token ids, positions and types (loop thread)."""
        slot = step_index % self.NUM_SLOTS
        images = [c for c in chunks if c.pixels is not None]
        if images:
            chunks = [c for c in chunks if c.pixels is None]
        if any(c.adapter is not None for c in chunks):
            # each LoRA adapter's tokens in one run: its matmuls read a slice, no gather/scatter
            chunks = sorted(chunks, key=lambda c: -1 if c.adapter is None else c.adapter)
        num_tokens, has_types = 0, False
        vision: tuple[ChunkImages, ...] = ()
        if chunks:
            ids = np.concatenate([c.token_ids for c in chunks])  # [num_tokens]
            positions = np.concatenate(
                [_positions(c, self.position_rows) for c in chunks], axis=-1
            )  # [num_tokens], M-RoPE: [3, num_tokens]
            num_tokens = len(ids)
            self.host_ids[slot, :num_tokens].copy_(torch.from_numpy(ids))
            self.host_pos[slot, ..., :num_tokens].copy_(torch.from_numpy(positions))
            vision = _step_images(chunks)
            has_types = any(c.token_type_ids is not None for c in chunks)
            if has_types:
                types = np.concatenate([_types_or_zeros(c) for c in chunks])  # [num_tokens]
                self.host_types[slot, :num_tokens].copy_(torch.from_numpy(types))
        if not images:
            return PreparedStep(
                step_index, tuple(chunks), num_tokens, slot, has_types, vision=vision
            )
        taken = cast("ImageInputs", self.loaded.images)
        batched, grids = taken.batch([cast("np.ndarray", c.pixels) for c in images])
        pixels = torch.from_numpy(batched)
        return PreparedStep(
            step_index,
            (*chunks, *images),
            num_tokens + sum(len(c.token_ids) for c in images),
            slot,
            has_types,
            num_texts=len(chunks),
            num_text_tokens=num_tokens,
            pixels=pixels.pin_memory() if self.is_cuda else pixels,
            grids=grids,
        )

    def execute(self, step: PreparedStep) -> StepResult:
        """Forward, pool and start the D2H copy of finished outputs (worker thread)."""
        started_at = time.monotonic()
        start = time.perf_counter()
        try:
            if self.step_threads is not None:
                tower_flops = pending_patches(step.vision) * self.patch_flops if step.vision else 0
                self.step_threads.apply(step.num_tokens, tower_flops)
            with torch.inference_mode():
                pooled = self._pool_texts(step) + self._pool_images(step)
                finished = [
                    (c.request_id, p.output)
                    for c, p in zip(step.chunks, pooled, strict=True)
                    if p.output is not None
                ]
                outputs, copy_done = self._to_host(finished)
        except BaseException:
            # The step's requests fail: their chunks already planned into the next step must be
            # skipped, and this thread runs that step next, so mark them here, before it starts.
            for chunk in step.chunks:
                chunk.pooler.abandon()
            raise
        failures = tuple(
            PoolingFailure(c.request_id, p.error)
            for c, p in zip(step.chunks, pooled, strict=True)
            if p.error is not None
        )
        return StepResult(
            step.step_index,
            outputs,
            failures,
            copy_done,
            step.num_tokens,
            time.perf_counter() - start,
            started_at,
        )

    def _pool_texts(self, step: PreparedStep) -> list[PooledChunk]:
        """The token stream's forward, each text chunk pooled from its rows."""
        texts = step.texts
        if not texts:
            return []
        hidden = self._forward(step)  # [num_tokens, hidden]
        return pool_chunks(hidden, _chunk_inputs(texts), [c.pooler for c in texts])

    def _pool_images(self, step: PreparedStep) -> list[PooledChunk]:
        """The image tower over the step's images, batched; each image's embedding pooled as a
        one-row prompt (its request's pooler applies only the embed head's normalization)."""
        images = step.images
        if not images or step.pixels is None:
            return []
        model = cast("ImageModel", self.loaded.model)
        pixels = step.pixels.to(self.device, non_blocking=True)
        rows = model.embed_images(pixels, step.grids)  # [n, dim]
        return pool_chunks(rows, [ONE_ROW] * len(images), [c.pooler for c in images])

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """Copy inputs to the device, build attention metadata, run the model."""
        n = step.num_tokens if step.num_text_tokens is None else step.num_text_tokens
        slot = step.slot
        ids = self.dev_ids[slot, :n]
        pos = self.dev_pos[slot, ..., :n]
        ids.copy_(self.host_ids[slot, :n], non_blocking=True)
        pos.copy_(self.host_pos[slot, ..., :n], non_blocking=True)
        types = None
        if step.has_token_types:
            types = self.dev_types[slot, :n]
            types.copy_(self.host_types[slot, :n], non_blocking=True)
        chunks = step.texts
        attn = build_attention_metadata(
            seq_lens_q=[len(c.token_ids) for c in chunks],
            context_lens=[c.context_len for c in chunks],
            write_kv=[c.num_kv_tokens > 0 for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            num_write_tokens=[c.num_kv_tokens for c in chunks],
            block_size=self.block_size,
            device=self.device,
            causal=self.loaded.spec.is_causal,
        )
        segments = AdapterSegments.from_chunks(
            [c.adapter for c in chunks], [len(c.token_ids) for c in chunks], self.device
        )
        # only adapted models take adapters, only vision-language ones image rows
        extra: dict[str, object] = {} if segments is None else {"adapters": segments}
        if step.vision:
            tower = cast("ImageTower", self.loaded.model)
            extra["vision"] = cut_vision_rows(tower, step.vision, self.device)
        return self.loaded.model(
            ids, pos, attn, self.kv_cache, out=self.hidden, token_type_ids=types, **extra
        )

    def _to_host(
        self, finished: list[tuple[int, torch.Tensor]]
    ) -> tuple[tuple[tuple[int, np.ndarray], ...], torch.cuda.Event | None]:
        """Move finished outputs to host memory the next step cannot overwrite."""
        if self.copy_stream is None:
            # CPU: a hand-off to the loop. Under async scheduling the pooler already cloned views
            # of the hidden buffer; without it, the next step starts only after this copy.
            return tuple((rid, self._owned_on_cpu(out).numpy()) for rid, out in finished), None
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            host = tuple((rid, out.to("cpu", non_blocking=True).numpy()) for rid, out in finished)
            for _, out in finished:
                out.record_stream(self.copy_stream)  # keep device memory alive until copied
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if not self.async_scheduling:
            event.synchronize()  # views were handed out: copy before the next step may run
        return host, event

    def _owned_on_cpu(self, out: torch.Tensor) -> torch.Tensor:
        """The output itself, or a copy when it still views the hidden buffer without async."""
        shares = out.untyped_storage().data_ptr() == self.hidden.untyped_storage().data_ptr()
        return out.clone() if shares and not self.async_scheduling else out


def _chunk_inputs(chunks: Sequence[ChunkWork]) -> list[ChunkInput]:
    """What pooling needs of each chunk (an int64 array serves as a sequence of ints)."""
    return [
        ChunkInput(len(c.token_ids), cast("Sequence[int]", c.token_ids), c.is_last) for c in chunks
    ]


def _positions(chunk: ChunkWork, rows: int) -> np.ndarray:
    """A chunk's positions: its prompt's own M-RoPE rows where it holds images, else its
    indices in the prompt (on every row)."""
    start, end = chunk.context_len, chunk.context_len + len(chunk.token_ids)
    if chunk.images is not None:
        return chunk.images.positions[:, start:end]  # [3, num_tokens]
    positions = np.arange(start, end)  # [num_tokens]
    return positions if rows == 1 else np.broadcast_to(positions, (rows, end - start))


def _step_images(chunks: Sequence[ChunkWork]) -> tuple[ChunkImages, ...]:
    """The image tokens of a step's packed chunks, in order."""
    found, offset = [], 0
    for chunk in chunks:
        found.append(chunk_images(chunk.images, chunk.context_len, len(chunk.token_ids), offset))
        offset += len(chunk.token_ids)
    return tuple(c for c in found if c is not None)


def _types_or_zeros(chunk: ChunkWork) -> np.ndarray:
    """The chunk's token type ids, or type 0 for each of its tokens."""
    if chunk.token_type_ids is not None:
        return chunk.token_type_ids
    return np.zeros(len(chunk.token_ids), dtype=np.int64)  # [num_tokens]
