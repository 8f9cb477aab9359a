"""Which LoRA adapter sits in which of the workers' --max-loras GPU slots: the scheduler decides, the plan says.

Why the scheduler owns it: it alone knows which adapters the running requests use, so it alone can tell which
slot may be overwritten. The workers hold exactly --max-loras slots and load what `StepPlan.lora_loads` says
into them before the step's forward pass; they never choose.

Slots are numbered 1..max_loras, as NewRequest.lora_slot counts them (0: the base model). An adapter is keyed by
(name, path, generation), so that an adapter unloaded and loaded again under the same name (from another
directory, or from the same one after its files changed: each load is a new generation) is never taken for the
one still sitting in a slot. A request is given its slot when it gets a worker row (admitted, or
resumed after a preemption): its adapter's slot if it has one, else a free slot, else the least recently used
slot whose adapter no running request uses (LRU). The planner admits a request only while the running requests
hold at most max_loras distinct adapters with it (step_planner.py), so such a slot always exists; a running
request's slot is never taken from it. After a worker loss the new workers hold nothing: `forget` starts over,
and every slot assigned afterwards is loaded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

LoraKey = tuple[str, str, int]  # (adapter name, adapter directory, load generation: Request.lora_key)


@dataclass(frozen=True)
class LoraLoadData:
    """Load the adapter at `path` (served as `name`) into GPU slot `slot` before the step's forward pass."""

    slot: int
    name: str
    path: str
    generation: int = 0


class LoraSlots:
    """The slot of each adapter the workers hold, in least-recently-used-first order (an OrderedDict: moving
    an adapter to the end on each use and taking the first evictable one are both cheap)."""

    def __init__(self, max_loras: int) -> None:
        self._max_loras = max_loras
        self._slots: OrderedDict[LoraKey, int] = OrderedDict()

    def assign(self, key: LoraKey, in_use: Collection[LoraKey]) -> tuple[int, LoraLoadData | None]:
        """The slot for a request of adapter `key` getting a worker row, and the load the plan must carry (None
        when the adapter already sits in a slot). `in_use`: the adapters of the running requests, never evicted."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot, None
        taken = set(self._slots.values())
        free = next((s for s in range(1, self._max_loras + 1) if s not in taken), None)
        if free is None:
            victim = next((k for k in self._slots if k not in in_use and k != key), None)
            if victim is None:
                raise RuntimeError(f"no LoRA slot for {key[0]!r}: all {self._max_loras} hold adapters in use "
                                   "(the planner admits at most --max-loras distinct adapters)")
            free = self._slots.pop(victim)
        self._slots[key] = free
        return free, LoraLoadData(free, *key)

    def slot_of(self, key: LoraKey) -> int | None:
        """The adapter's slot, or None while it sits in none."""
        return self._slots.get(key)

    def forget(self) -> None:
        """The workers were replaced: no slot holds anything any more."""
        self._slots.clear()
