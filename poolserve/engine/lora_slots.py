"""The LoRA adapters an engine serves: every registered adapter in host memory, at most
--max-loras of them resident in the model's stacked slots, least recently used evicted.

A request names its adapter; the engine asks for the adapter's slot as it admits the request
(`acquire`): a resident adapter's slot, else the adapter is written into a free slot or into the
least recently used one no admitted request holds (a slot held by queued or running requests is
never rewritten). Every slot held: the request is refused as overload (429) before any work.
Each admitted request holds its slot until its future is done. Unloading removes the name at
once (new requests for it are refused) and clears its slot once the last request holding it is
done (`unregister`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import torch

from poolserve.models.adapters import StackedLora
from poolserve.models.heads import HeadFactory
from poolserve.models.packed import PackedModel
from poolserve.models.peft import PeftAdapter, check_adapter, write_adapter
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import (
    InvalidPoolingParamsError,
    LoraAdapterExistsError,
    LoraAdapterNotFoundError,
    OverloadedError,
    OverloadReason,
)
from poolserve.types.lora import LoraModule

logger = logging.getLogger(__name__)
# a slot frees as soon as one request of its adapter is done: a short wait
ADAPTER_RETRY_AFTER_S = 1.0


@dataclass
class _Slot:
    """One index of the model's stacked adapters."""

    name: str | None = None  # the resident adapter (None: free)
    holders: int = 0  # admitted requests not yet done that run through it
    last_used: int = 0  # the admission counter when a request last took it
    emptied: asyncio.Event = field(default_factory=asyncio.Event)  # set while no request holds it


class AdapterSlots:
    """Registered adapters (by name, in host memory) and the model's slots they run in."""

    def __init__(
        self,
        model: PackedModel,
        capacity: int,
        max_rank: int,
        head: HeadFactory | None = None,
    ) -> None:
        self.model = model
        self.head = head
        # an adapter that trains the head: its own head module (run per request, merged)
        self.heads: dict[str, torch.nn.Module] = {}
        self.max_rank = max_rank
        self._slots = [_Slot() for _ in range(capacity)]
        for slot in self._slots:
            slot.emptied.set()
        self._registered: dict[str, tuple[LoraModule, PeftAdapter]] = {}
        self._clock = itertools.count(1)
        self.evictions = 0

    @property
    def modules(self) -> tuple[LoraModule, ...]:
        """Every registered adapter, in registration order (what front ends route by name)."""
        return tuple(module for module, _ in self._registered.values())

    @property
    def num_resident(self) -> int:
        """How many adapters sit in the model's slots now."""
        return sum(slot.name is not None for slot in self._slots)

    def check_new(self, name: str) -> None:
        """LoraAdapterError when an adapter of this name is registered already."""
        if name in self._registered:
            raise LoraAdapterExistsError(name)

    def register(self, module: LoraModule, adapter: PeftAdapter) -> None:
        """Add an adapter after checking it fits the model (LoraAdapterError naming why not)."""
        self.check_new(module.name)
        head = check_adapter(self.model, adapter, self.max_rank, self.head)
        self._registered[module.name] = (module, adapter)
        if head is not None:
            self.heads[module.name] = head

    def acquire(self, name: str, count: int = 1) -> int:
        """The slot running adapter `name` for `count` more admitted requests (written in
        first when it is not resident); `release` each when it is done."""
        if name not in self._registered:
            have = list(self._registered) or "none"
            raise InvalidPoolingParamsError("adapter", f"{name!r} is not loaded (loaded: {have})")
        index = self._resident(name)
        if index is None:
            index = self._make_room(name)
            self._write(index, name)
        slot = self._slots[index]
        slot.holders += count
        slot.last_used = next(self._clock)
        slot.emptied.clear()
        return index

    def release(self, index: int, count: int = 1) -> None:
        """`count` requests holding slot `index` are done."""
        slot = self._slots[index]
        slot.holders -= count
        if slot.holders == 0:
            slot.emptied.set()

    async def unregister(self, name: str) -> None:
        """Remove adapter `name`: refused from now on, its slot cleared once no request holds
        it (LoraAdapterNotFoundError when it is not registered)."""
        if self._registered.pop(name, None) is None:
            raise LoraAdapterNotFoundError(name)
        self.heads.pop(name, None)
        index = self._resident(name)
        if index is None:
            return
        slot = self._slots[index]
        await slot.emptied.wait()
        if slot.name == name:  # nothing took the slot while the last requests ran
            self._clear(index)

    def _resident(self, name: str) -> int | None:
        return next((i for i, slot in enumerate(self._slots) if slot.name == name), None)

    def _make_room(self, name: str) -> int:
        """A free slot, else the least recently used one no request holds."""
        free = [i for i, slot in enumerate(self._slots) if slot.name is None]
        if free:
            return free[0]
        idle = [i for i, slot in enumerate(self._slots) if slot.holders == 0]
        if not idle:
            raise OverloadedError(
                OverloadReason.ADAPTER_SLOTS,
                ADAPTER_RETRY_AFTER_S,
                f"LoRA adapter {name!r} waits for a slot: all {len(self._slots)} "
                "(--max-loras) run other adapters' requests; retry",
            )
        index = min(idle, key=lambda i: self._slots[i].last_used)
        self.evictions += 1
        logger.info("LoRA: %r evicted from slot %d for %r", self._slots[index].name, index, name)
        self._clear(index)
        return index

    def _write(self, index: int, name: str) -> None:
        _, adapter = self._registered[name]
        write_adapter(self.model, index, adapter, self.max_rank)
        self._slots[index].name = name
        self._sync_names()

    def _clear(self, index: int) -> None:
        for module in self.model.modules():
            if isinstance(module, StackedLora):
                module.clear(index)
        self._slots[index].name = None
        self._sync_names()

    def preload(self) -> None:
        """The first registered adapters written into the free slots (--lora-modules at start)."""
        for name in list(self._registered)[: len(self._slots)]:
            if self._resident(name) is None:
                self._write(self._make_room(name), name)

    def _sync_names(self) -> None:
        """The model's adapter names by slot ("" where free): its forward takes adapters."""
        self.model.adapter_names = tuple(slot.name or "" for slot in self._slots)


def adapter_slots(loaded: LoadedModel) -> AdapterSlots | None:
    """The model's adapter slots with --lora-modules' adapters registered and written in;
    None when LoRA is not served."""
    if loaded.lora is None:
        return None
    serving = loaded.lora.serving
    slots = AdapterSlots(
        loaded.model, serving.max_loras, serving.max_lora_rank, loaded.head_factory
    )
    for module, adapter in loaded.lora.adapters:
        slots.register(module, adapter)
    slots.preload()
    return slots
