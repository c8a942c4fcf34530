"""Slot bookkeeping of the cuda_ipc ring (torch-free, so it is tested on any machine).

A slot is taken for one Propose and comes back only when the reply to that call has arrived: the
drafter has finished reading the rows before it replies. The slot of a failed call never comes back (the
drafter may still be reading it); the sender opens the transport again with a fresh ring.
"""

from __future__ import annotations

from collections import deque


class RingFull(RuntimeError):
    pass


class SlotRing:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = deque(range(num_slots))
        self._busy: set[int] = set()
        self.lost: set[int] = set()

    def acquire(self) -> int:
        if not self._free:
            raise RingFull(f"all {self.num_slots} slots are in flight or lost ({sorted(self.lost)} lost)")
        slot = self._free.popleft()
        self._busy.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """The reply to the call that used `slot` has arrived."""
        self._take_busy(slot)
        self._free.append(slot)

    def lose(self, slot: int) -> None:
        """The call that used `slot` failed: the drafter may still read it, so it is never reused."""
        self._take_busy(slot)
        self.lost.add(slot)

    def _take_busy(self, slot: int) -> None:
        if slot not in self._busy:
            raise ValueError(f"slot {slot} is not in flight")
        self._busy.remove(slot)

    @property
    def in_flight(self) -> int:
        return len(self._busy)
