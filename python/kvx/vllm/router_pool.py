"""The router's engines of one kind (``EnginePool``): which one takes the next request, and
which ones are down.

An engine is **down** from the moment a request to it fails to connect, or its connection
breaks before or while it answers (its process died, or restarted), or its ``/health`` has
not answered for ``engine_liveness_sec`` (its process is stopped or hung, or its link is
down: nothing breaks, it only falls silent). It gets no new request until its ``/health``
answers again, which the router asks of every engine every ``health_interval_sec``. So a
dead engine costs at most the requests that were on it when it died, not every later
request; a silent one's requests in flight are ended by the aborts each registered on its
slot (``Slot.aborts``), since nothing else would end them. Among the engines that are up, ``take`` chooses the one with the fewest
requests in flight, the least recently chosen among equals. Does not import aiohttp.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, List, Optional, Sequence, Set, TypeVar

E = TypeVar("E")


@dataclass
class Slot(Generic[E]):
    """One engine, its requests in flight, and why it is down (None: up)."""

    engine: E
    in_flight: int = 0
    last_pick: int = 0
    down_since: Optional[float] = None
    why_down: Optional[str] = None
    #: When its ``/health`` last answered (or the router started).
    last_answer: float = field(default_factory=time.monotonic)
    #: Ends a request in flight on this engine, saying why: called when the engine falls
    #: silent (each request adds its own and removes it when it ends).
    aborts: Set[Callable[[str], None]] = field(default_factory=set)


class EnginePool(Generic[E]):
    """Engines of one kind; ``take`` chooses among those up and counts the request until
    ``done``."""

    def __init__(self, engines: Sequence[E]) -> None:
        self._slots = [Slot(e) for e in engines]
        self._picks = itertools.count(1)

    def take(self, avoid: Sequence[Slot[E]] = ()) -> Optional[Slot[E]]:
        """The up engine (not one of ``avoid``) with the fewest requests in flight, the least
        recently chosen among equals; None when none is up."""
        up = [s for s in self._slots if s.down_since is None and not any(s is a for a in avoid)]
        if not up:
            return None
        slot = min(up, key=lambda s: (s.in_flight, s.last_pick))
        slot.in_flight += 1
        slot.last_pick = next(self._picks)
        return slot

    @staticmethod
    def done(slot: Slot[E]) -> None:
        slot.in_flight -= 1

    @staticmethod
    def mark_down(slot: Slot[Any], why: str) -> bool:
        """``slot``'s engine failed a connection; whether it was up until now."""
        was_up = slot.down_since is None
        if was_up:
            slot.down_since = time.monotonic()
        slot.why_down = why
        return was_up

    @staticmethod
    def mark_up(slot: Slot[Any]) -> None:
        slot.down_since = None
        slot.why_down = None

    @staticmethod
    def answered(slot: Slot[Any]) -> None:
        """``slot``'s ``/health`` answered just now."""
        slot.last_answer = time.monotonic()

    @staticmethod
    def silent_for(slot: Slot[Any]) -> float:
        """Seconds since ``slot``'s ``/health`` last answered."""
        return time.monotonic() - slot.last_answer

    def slots(self) -> List[Slot[E]]:
        return list(self._slots)

    def down(self) -> List[Slot[E]]:
        return [s for s in self._slots if s.down_since is not None]

    def in_flight(self) -> List[int]:
        return [s.in_flight for s in self._slots]

    def up_count(self) -> int:
        return sum(1 for s in self._slots if s.down_since is None)


__all__ = ["EnginePool", "Slot"]
