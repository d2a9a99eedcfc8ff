"""The engine loop: one asyncio task owns the scheduler state; one worker thread runs the model."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, cast

import numpy as np
import torch

from poolserve.engine.bridge import pooling_info_from
from poolserve.engine.lora_slots import adapter_slots
from poolserve.engine.runner import PreparedStep, Runner, StepResult
from poolserve.engine.sched.planner import max_prompt_tokens, plan_step
from poolserve.engine.sched.prefix_cache import CacheUse, PrefixCache
from poolserve.engine.sched.queues import RequestQueues
from poolserve.engine.sched.request import PoolingRequest, RequestStatus
from poolserve.engine.turns import Seat
from poolserve.engine.vision_rows import RequestImages
from poolserve.models.loader import read_adapter
from poolserve.models.spec import LoadedModel
from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import build_pooler, get_supported_tasks
from poolserve.types.admission import AdmissionControl
from poolserve.types.errors import (
    DrainingError,
    EngineDeadError,
    InvalidPoolingParamsError,
    InvalidRequestError,
    LoraAdapterError,
    LoraAdapterNotFoundError,
    OverloadedError,
    PoolingConfigError,
    StepFailedError,
)
from poolserve.types.images import image_prompt
from poolserve.types.limits import SchedulerConfig
from poolserve.types.lora import LoraModule
from poolserve.types.model_info import HEAD_FIELDS, PoolingModelInfo
from poolserve.types.observer import EngineObserver, NullObserver
from poolserve.types.outputs import PoolingOutput, StepTiming
from poolserve.types.params import NO_CALIBRATION, LogitCalibration, PoolingParams
from poolserve.types.prompts import checked_prompt, checked_token_types
from poolserve.types.stats import EngineSnapshot, LoraStats
from poolserve.types.tasks import PoolingTask, PoolingType
from poolserve.types.validation import prompt_params, validate_params
from poolserve.types.vision import PromptImages

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching pooling engine: submit prompts, await outputs."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: SchedulerConfig,
        device: torch.device,
        *,
        max_model_len: int | None = None,
        embed_pooling: PoolingType | None = None,
        pooler_task: PoolingTask | None = None,
        observer: EngineObserver | None = None,
        calibration: LogitCalibration = NO_CALIBRATION,
        turns_seat: Seat | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.device = device
        limit = min(max_model_len or loaded.spec.max_model_len, loaded.spec.max_model_len)
        self.max_model_len = min(limit, max_prompt_tokens(config))
        self.observer = observer or NullObserver()
        self.pooling_info = pooling_info_from(loaded, embed_pooling, pooler_task)
        self.supported_tasks = get_supported_tasks(self.pooling_info)
        if pooler_task is not None and pooler_task not in self.supported_tasks:
            served = ", ".join(sorted(self.supported_tasks))
            raise ValueError(  # vLLM's words first: "Unsupported task"
                f"--pooler-config: Unsupported task {pooler_task.value!r}: the model serves "
                f"{served}"
            )
        images = loaded.images
        if images is not None and images.num_tokens > config.max_num_batched_tokens:
            raise ValueError(
                f"an image costs {images.num_tokens} tokens, above --max-num-batched-tokens "
                f"{config.max_num_batched_tokens}: raise it"
            )
        # --pooler-config's logit_mean/logit_sigma: part of the model, as in vLLM's pooler
        self.calibration = calibration
        self.clone_stats = CloneStats()
        self.runner = Runner(
            loaded,
            max_num_tokens=config.max_num_batched_tokens,
            num_kv_blocks=config.kv_blocks,
            block_size=config.block_size,
            device=device,
            async_scheduling=config.async_scheduling,
        )
        self.blocks = PrefixCache(config.kv_blocks, config.block_size)
        # Only causal attention makes a position's KV a function of the tokens up to it.
        self.prefix_caching = config.enable_prefix_caching and loaded.spec.is_causal
        self.admission = AdmissionControl.from_config(config)
        self.queues = RequestQueues(self.blocks, self.admission, config)
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poolserve-model")
        # with other engines on the device (one core, several models): each forward takes a turn
        self.turns_seat = turns_seat
        self._loop_task: asyncio.Task[None] | None = None
        self.draining = False
        self.dead_reason: str | None = None
        self.num_steps = 0
        self.step_tokens_total = 0
        # PEFT LoRA adapters (--lora-modules, /v1/load_lora_adapter); None: LoRA not served
        self.adapters = adapter_slots(loaded)
        self._adapter_infos: dict[str, PoolingModelInfo] = {}  # pooling's view per adapter head
        self._image_pooling: PoolingModelInfo | None = None  # an image's embedding, as pooled

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop task on the running event loop."""
        self._loop_task = asyncio.get_running_loop().create_task(
            self._run(), name="poolserve-engine"
        )

    @property
    def is_alive(self) -> bool:
        """True while the loop task runs."""
        return self._loop_task is not None and not self._loop_task.done()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting, finish in-flight work within the timeout, then stop; True if clean."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.queues and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        clean = not self.queues
        for request in list(self.queues.by_id.values()):
            self.queues.cancel(request)
        await self.stop()
        return clean

    async def stop(self) -> None:
        """Stop the loop task and the worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    # ---- admission ---------------------------------------------------------------------------
    def precheck(self, num_requests: int) -> None:
        """Refuse before any tokenization when the engine cannot take num_requests more."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.draining:
            raise DrainingError()
        try:
            self.admission.precheck(num_requests)
        except OverloadedError as exc:
            self.observer.on_reject(exc.reason.value)
            raise

    def check_params(self, params: PoolingParams) -> None:
        """Refuse parameters this model cannot serve, before any work is done for them."""
        validate_params(self.pooling_info, params)

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: PoolingParams,
        priority: int = 0,
        token_type_ids: Sequence[Sequence[int] | None] | None = None,
        *,
        checked: bool = False,
        pixels: Sequence[np.ndarray | None] | None = None,
        media: Sequence[PromptImages | None] | None = None,
    ) -> list[asyncio.Future[PoolingOutput]]:
        """Admit all prompts (each with optional type ids) or none; each gets a future.

        `checked`: the prompts are int64 arrays whose lengths, ids, type ids and parameters
        were already checked against this engine (by a front end holding its model card), so
        the engine's one thread does not do that work again. `pixels`: per prompt, an image's
        pixel values (its prompt then stands for the image's tokens), or None for a text.
        `media`: per prompt of a vision-language model, the images its placeholders stand for.
        """
        self.precheck(len(prompts))
        images = list(pixels) if pixels is not None else [None] * len(prompts)
        if checked:
            token_ids = cast("list[np.ndarray]", list(prompts))
            types = cast("list[np.ndarray | None]", list(token_type_ids or [None] * len(token_ids)))
        else:
            vocab_size = self.loaded.spec.vocab_size
            token_ids = [
                checked_prompt(p, self.max_model_len, vocab_size)
                if image is None
                else image_prompt(image, self.loaded.images)
                for p, image in zip(prompts, images, strict=True)
            ]
            num_types = self.loaded.model.num_token_types
            types = checked_token_types(token_type_ids, token_ids, num_types)
            self.check_params(params)
        inline = self._inline_images(token_ids, media)
        # late chunking: each prompt its own token spans, within it (refused before admission)
        own_params = prompt_params(params, [len(ids) for ids in token_ids])
        try:
            adapter = self._take_adapter(params, len(token_ids))
            self._reserve(token_ids, adapter)
        except OverloadedError as exc:
            self.observer.on_reject(exc.reason.value)
            raise
        loop = asyncio.get_running_loop()
        futures = []
        for ids, type_ids, own, image, held in zip(
            token_ids, types, own_params, images, inline, strict=True
        ):
            request = self._new_request(ids, type_ids, own, priority, loop, image)
            request.images = held
            if adapter is not None:
                # an adapter changes every state: cached blocks never serve another adapter
                request.adapter, request.cache_use = adapter, CacheUse.NONE
                if self.adapters is not None:  # its slot is held until the request is done
                    request.future.add_done_callback(partial(self._request_done, adapter))
            self.queues.add(request)
            futures.append(request.future)
        self._wake.set()
        return futures

    async def submit(
        self,
        prompt: Sequence[int],
        params: PoolingParams,
        priority: int = 0,
        token_type_ids: Sequence[int] | None = None,
    ) -> PoolingOutput:
        """Submit one prompt and await its output (cancelling the await cancels the request)."""
        (future,) = self.submit_many([prompt], params, priority, [token_type_ids])
        return await self.wait(future)

    async def wait(self, future: asyncio.Future[PoolingOutput]) -> PoolingOutput:
        """Await one output; if the caller goes away, the request's work is freed."""
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel_future(future)
            raise

    def cancel_future(self, future: asyncio.Future[PoolingOutput]) -> None:
        """Cancel the request behind a future returned by submit_many."""
        request = self.queues.request_of(future)
        if request is not None:
            self.queues.cancel(request)

    def _new_request(
        self,
        token_ids: np.ndarray,
        token_type_ids: np.ndarray | None,
        params: PoolingParams,
        priority: int,
        loop: asyncio.AbstractEventLoop,
        pixels: np.ndarray | None = None,
    ) -> PoolingRequest:
        info = self._pooling_info(params.adapter) if pixels is None else self._image_info()
        pooler = build_pooler(
            info,
            params,
            async_scheduling=self.config.async_scheduling,
            stats=self.clone_stats,
            calibration=self.calibration,
        )
        request_id = next(self._ids)
        return PoolingRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            token_type_ids=token_type_ids,
            pooler=pooler,
            future=loop.create_future(),
            arrival_time=time.monotonic(),
            arrival_index=request_id,
            priority=priority,
            cache_use=CacheUse.NONE
            if pixels is not None
            else self._cache_use(pooler.pooling_type, token_type_ids),
            steps=[] if self.config.record_timelines else None,
            pixels=pixels,
        )

    def _inline_images(
        self, token_ids: Sequence[np.ndarray], media: Sequence[PromptImages | None] | None
    ) -> list[RequestImages | None]:
        """Each prompt's images placed among its tokens (refused unless its placeholders are
        exactly theirs); a placeholder without an image is refused too."""
        inline = self.loaded.inline_images
        held = list(media) if media is not None else [None] * len(token_ids)
        if inline is None:
            if any(m is not None for m in held):
                raise InvalidRequestError("this model takes no images inside its prompts", "input")
            return [None] * len(token_ids)
        placed: list[RequestImages | None] = []
        for ids, images in zip(token_ids, held, strict=True):
            if images is not None:
                placed.append(RequestImages(images, np.asarray(ids), inline))
            elif bool(np.any(np.asarray(ids) == inline.image_token_id)):
                raise InvalidRequestError(
                    f"the prompt holds the image placeholder {inline.image_token!r} but no "
                    "image: send images as image_url parts",
                    "input",
                )
            else:
                placed.append(None)
        return placed

    def _image_info(self) -> PoolingModelInfo:
        """Pooling's view of an image's one row: its embedding, so no text head projects it
        (the image tower's own projection already did); normalization and the rest as texts'."""
        if self._image_pooling is None:
            images = self.loaded.images
            if images is None:
                raise PoolingConfigError(f"{self.loaded.spec.architecture} takes no images")
            size = images.embedding_size
            self._image_pooling = dataclasses.replace(
                self.pooling_info, embed_projection=None, hidden_size=size, embed_output_size=size
            )
        return self._image_pooling

    def _pooling_info(self, adapter: str | None) -> PoolingModelInfo:
        """Pooling's view of the model a request runs: an adapter that trains the head has its
        own head module (its classifier), every other request the model's."""
        if self.adapters is None or adapter is None or adapter not in self.adapters.heads:
            return self.pooling_info
        head = self.adapters.heads[adapter]
        field = HEAD_FIELDS[self.loaded.spec.head_kind]
        cached = self._adapter_infos.get(adapter)
        if cached is None or getattr(cached, field) is not head:
            heads: dict[str, Any] = {field: head}
            cached = dataclasses.replace(self.pooling_info, **heads)
            self._adapter_infos[adapter] = cached
        return cached

    def _take_adapter(self, params: PoolingParams, count: int) -> int | None:
        """The adapter's index for `count` requests; a refusal (every slot busy) is counted."""
        try:
            return self._adapter_index(params, count)
        except OverloadedError as exc:
            self.admission.count_refusal(exc.reason)
            raise

    def _reserve(self, token_ids: Sequence[np.ndarray], adapter: int | None) -> None:
        """Admission's room for the prompts; refused, the adapter's slot is let go again."""
        try:
            self.admission.reserve(len(token_ids), sum(len(ids) for ids in token_ids))
        except OverloadedError:
            self._release_adapter(adapter, len(token_ids))
            raise

    def _adapter_index(self, params: PoolingParams, count: int) -> int | None:
        """The index of the LoRA adapter `params` names among the model's (a PEFT adapter's
        slot, held for `count` requests); None: none named."""
        if params.adapter is None:
            return None
        if self.adapters is not None:
            return self.adapters.acquire(params.adapter, count)
        names = self.loaded.model.adapter_names
        if params.adapter not in names:
            have = f"one of the model's adapters {list(names)}" if names else "served: no adapters"
            why = f"{params.adapter!r} is not {have}"
            raise InvalidPoolingParamsError("adapter", why)
        return names.index(params.adapter)

    def _release_adapter(self, index: int | None, count: int) -> None:
        """`count` requests holding a PEFT adapter's slot are done (or were never admitted)."""
        if self.adapters is not None and index is not None:
            self.adapters.release(index, count)

    def _request_done(self, index: int, future: asyncio.Future[PoolingOutput]) -> None:
        self._release_adapter(index, 1)

    async def load_adapter(self, module: LoraModule) -> None:
        """Register a PEFT adapter at run time (read off the loop; LoraAdapterError if it does
        not fit, or when LoRA is not served)."""
        if self.adapters is None:
            raise LoraAdapterError(module.name, "LoRA is not served: start with --enable-lora")
        self.adapters.check_new(module.name)
        adapter = await asyncio.to_thread(read_adapter, module)
        self.adapters.register(module, adapter)

    async def unload_adapter(self, name: str) -> None:
        """Remove a PEFT adapter once its admitted requests are done."""
        if self.adapters is None:
            raise LoraAdapterNotFoundError(name)
        await self.adapters.unregister(name)

    def _cache_use(self, pooling_type: PoolingType, token_type_ids: np.ndarray | None) -> CacheUse:
        """Share cached prefixes only when pooling reads nothing but the last position."""
        if not self.prefix_caching or token_type_ids is not None:
            return CacheUse.NONE  # with token types a block's KV is not a function of its ids
        return CacheUse.SHARE if pooling_type is PoolingType.LAST else CacheUse.DONATE

    # ---- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        """Plan step N+1 while step N runs; deliver N's outputs; repeat."""
        loop = asyncio.get_running_loop()
        inflight: deque[tuple[PreparedStep, asyncio.Future[StepResult]]] = deque()
        depth = 2 if self.config.async_scheduling else 1
        while True:
            prepared = self._plan_and_prepare(ahead=bool(inflight))
            if prepared is not None:
                inflight.append(
                    (prepared, loop.run_in_executor(self._worker, self._execute, prepared))
                )
            if not inflight:
                self._wake.clear()
                await self._wake.wait()
            elif len(inflight) >= depth or prepared is None:
                step, pending = inflight.popleft()
                await self._finish_step(step, pending)

    def _execute(self, step: PreparedStep) -> StepResult:
        """Run a step (model worker thread), in this engine's turn when it shares the device."""
        if self.turns_seat is None:
            return self.runner.execute(step)
        with self.turns_seat.turn():
            return self.runner.execute(step)

    def _plan_and_prepare(self, ahead: bool = False) -> PreparedStep | None:
        """Plan the next step and fill its host buffers; None when there is nothing to run, or
        when it is background work and a step runs (`ahead`): background steps are never
        planned behind another step, so interactive work that arrives meanwhile goes next."""
        if not self.queues.has_work:
            return None
        waiting, running = self.queues.planner_inputs()
        plan = plan_step(waiting, running, self.config, self.blocks.num_free)
        if plan.is_empty or (ahead and plan.background):
            return None
        return self.runner.prepare(next(self._steps), self.queues.apply(plan))

    async def _finish_step(self, step: PreparedStep, pending: asyncio.Future[StepResult]) -> None:
        """Await a step, then deliver its outputs, or fail its requests if it raised."""
        try:
            result = await pending
            if result.copy_done is not None:
                await asyncio.to_thread(result.copy_done.synchronize)
            _raise_fatal_failure(result)
        except Exception as exc:
            self._fail_step(step, exc)
            return
        self.num_steps += 1
        self.step_tokens_total += result.num_tokens
        self.observer.on_step(result.num_tokens, result.duration_s)
        self._update_throughput(result)
        self._deliver(step, result)

    def _deliver(self, step: PreparedStep, result: StepResult) -> None:
        """Resolve finished requests and fail those whose pooling raised; free the done ones."""
        outputs = dict(result.outputs)
        failures = {failure.request_id: failure.error for failure in result.failures}
        now = time.monotonic()
        for chunk in step.chunks:
            request = self.queues.step_delivered(chunk.request_id)
            if request is None:
                continue  # failed or cancelled meanwhile: what the step computed for it is dropped
            if chunk.request_id in failures:
                self._fail_pooling(request, failures[chunk.request_id])
                continue
            self.queues.offer_written(request, chunk)
            if request.steps is not None:
                request.steps.append(_timing(step, result, len(chunk.token_ids)))
            if chunk.request_id in outputs:
                self._resolve(request, outputs[chunk.request_id], now)
            elif chunk.is_last:
                # Never leave a caller waiting: a last chunk always ends its request.
                error = StepFailedError(f"request {request.request_id} got no pooled output")
                self.queues.fail(request, error)

    def _update_throughput(self, result: StepResult) -> None:
        """Smoothed tokens/s, so a 429's Retry-After reflects how fast the queue drains."""
        if result.duration_s <= 0:
            return
        current = result.num_tokens / result.duration_s
        previous = self.admission.throughput_tokens_per_s
        self.admission.throughput_tokens_per_s = (
            current if previous is None else 0.8 * previous + 0.2 * current
        )

    def _resolve(self, request: PoolingRequest, output: np.ndarray, now: float) -> None:
        """Hand a finished output to its caller and free the request."""
        request.status = RequestStatus.FINISHED
        result = request.output(output, now)
        self.observer.on_request_done(result.queue_time_s, result.inference_time_s)
        if not request.future.done():
            request.future.set_result(result)
        self.queues.release(request)

    def _fail_pooling(self, request: PoolingRequest, exc: Exception) -> None:
        """Fail one request whose pooling raised; the others of its step are unaffected."""
        logger.error("pooling failed for request %d", request.request_id, exc_info=exc)
        error = StepFailedError(f"pooling failed for request {request.request_id}: {exc}")
        error.__cause__ = exc
        self.queues.fail(request, error)

    def _fail_step(self, step: PreparedStep, exc: Exception) -> None:
        """Fail every request of a step that raised; mark the engine dead on device errors."""
        logger.error("step %d failed", step.step_index, exc_info=exc)
        error: Exception = StepFailedError(str(exc))
        if _is_fatal_device_error(exc):
            self.dead_reason = f"device error: {exc}"
            error = EngineDeadError(self.dead_reason)
        for chunk in step.chunks:
            request = self.queues.step_delivered(chunk.request_id)
            if request is not None:
                self.queues.fail(request, error)

    # ---- counters ------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Current gauges and counters for metrics."""
        return EngineSnapshot(
            num_running=self.queues.num_running(),
            num_waiting=len(self.queues.waiting),
            num_queued_tokens=self.admission.queued_tokens,
            num_kv_blocks_used=self.blocks.num_used,
            num_kv_blocks_total=self.blocks.num_total,
            num_steps=self.num_steps,
            step_tokens_total=self.step_tokens_total,
            cloned_bytes_total=self.clone_stats.cloned_bytes,
            num_clones=self.clone_stats.num_clones,
            num_open_poolers=self.clone_stats.num_open_poolers,
            rejected=self.admission.rejected_by_reason(),
            num_kv_blocks_cached=self.blocks.num_cached_free,
            prefix_cache_hit_tokens=self.blocks.num_hit_tokens,
            prefix_cache_miss_tokens=self.blocks.num_miss_tokens,
            prefix_cache_evictions=self.blocks.num_evictions,
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoraStats | None:
        """The adapters registered, resident and evicted, and those whose requests run and
        wait now (vLLM's lora_requests_info); None when LoRA is not served."""
        slots, served = self.adapters, self.loaded.lora
        if slots is None or served is None:
            return None
        names = self.loaded.model.adapter_names  # by slot: a held slot keeps its adapter

        def adapters(status: RequestStatus) -> tuple[str, ...]:
            held = {r.adapter for r in self.queues.by_id.values() if r.status is status}
            return tuple(sorted(names[i] for i in held if i is not None and names[i]))

        return LoraStats(
            max_loras=served.serving.max_loras,
            num_loaded=len(slots.modules),
            num_resident=slots.num_resident,
            evictions=slots.evictions,
            running=adapters(RequestStatus.RUNNING),
            waiting=adapters(RequestStatus.WAITING),
        )


def _timing(step: PreparedStep, result: StepResult, num_tokens: int) -> StepTiming:
    """A step as one of its requests' timelines records it."""
    return StepTiming(
        step.step_index,
        result.started_at,
        result.duration_s,
        step.num_tokens,
        len(step.chunks),
        num_tokens,
    )


def _raise_fatal_failure(result: StepResult) -> None:
    """A device error while pooling one request poisons the whole step, not just that request."""
    for failure in result.failures:
        if _is_fatal_device_error(failure.error):
            raise failure.error


def _is_fatal_device_error(exc: Exception) -> bool:
    """CUDA errors poison the context: nothing after them can be trusted."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(exc, accelerator_error) or "CUDA error" in str(exc)
