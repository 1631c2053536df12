"""Every interleaving of a small world, not a sample: an exhaustive search of the states the
swarm's ``World`` reaches (two real vLLM 0.33 schedulers, the connector on both, kvx's model
between them), as the core's explorer searches the chunk protocol's (``kvx-proto``
``tests/explore.rs``).

From the empty world, every enabled event is tried in every reached state: engine steps,
adds, kvx's events, and within a budget the faults (aborts on either engine, a corrupted
write, a receiver's timeout, the prefill engine's lost connection). States are told apart by
``World.fingerprint`` (the engines' requests, queues, blocks and KV bytes, both sides of the
connector, kvx's model), so a state reached by many orders is searched once. A state is
re-searched when reached with more of the fault budget left, whose futures are larger. The
fingerprint is checked as the search goes: states that share one must enable the same
events, however they were reached.

Checked in every state: the swarm's invariants after each event (``World.check``: writes
land only where they may, a running decode request holds exactly its prompt's KV), and, from
every state, that healing it (no more faults; every step and kvx event until nothing is
left) ends every request on both engines, frees every block and empties every book, and
serves every request no fault touched: no interleaving deadlocks or leaks.

A state is rebuilt by replaying its path from a new world (a few milliseconds), which is
cheaper than copying two engines' KV tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from swarm import FAULTS, Shape, World

Path = Tuple[int, ...]


def is_fault(choice: Tuple[str, Any]) -> bool:
    kind, arg = choice
    return kind == "abort" or (kind == "kvx" and arg[0] in FAULTS)


@dataclass
class Search:
    """One search's bounds and what it found."""

    shape: Shape
    #: Events in a path at most (the search reports when a path reached it).
    depth: int
    #: Faults in a path at most.
    faults: int
    num_blocks: int = 12
    #: Fingerprint → the most fault budget it was searched with.
    seen: Dict[Any, int] = field(default_factory=dict)
    #: (fingerprint, fault budget) → the events enabled there, for the fingerprint's check.
    enabled: Dict[Any, Tuple[Any, ...]] = field(default_factory=dict)
    states: int = 0
    edges: int = 0
    #: Paths the depth bound cut (0: the search reached every state within the fault budget).
    cut: int = 0
    #: Event kinds fired, over all paths.
    kinds: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def world(self, path: Path, trace: Optional[List[str]] = None) -> Tuple[World, int]:
        """The world ``path`` reaches, and the fault budget left there; each event fired is
        appended to ``trace`` when given."""
        world = World(0, num_blocks=self.num_blocks, shape=self.shape)
        left = self.faults
        for i in path:
            choice = world.choices(faults=left > 0)[i]
            left -= is_fault(choice)
            if trace is not None:
                trace.append(f"  {choice[0]} {choice[1]}")
            world.fire(choice)
        return world, left

    def run(self, limit: Optional[int] = None) -> "Search":
        """Searches until every state is seen (or ``limit`` states, for a smoke run)."""
        start = time.monotonic()
        stack: List[Path] = [()]
        while stack and (limit is None or self.states < limit):
            path = stack.pop()
            world, left = self._replayed(path)
            key = world.fingerprint()
            options = world.choices(faults=left > 0)
            # A fingerprint that left out something deciding the future would merge states
            # whose events differ: the events enabled must be the same however it was reached.
            enabled = tuple(options)
            if self.enabled.setdefault((key, left), enabled) != enabled:
                raise AssertionError(f"two states with one fingerprint enable different events:\n"
                                     f"{self.enabled[(key, left)]}\n{enabled}\n{self._trace(path)}")
            if self.seen.get(key, -1) >= left:
                continue
            self.seen[key] = left
            self.states += 1
            for kind, arg in options:
                name = arg[0] if kind == "kvx" else kind
                self.kinds[name] = self.kinds.get(name, 0) + 1
            if len(path) >= self.depth:
                self.cut += 1
            else:
                self.edges += len(options)
                stack.extend(path + (i,) for i in reversed(range(len(options))))
            self._heal(world, path)
        self.seconds = time.monotonic() - start
        return self

    def _replayed(self, path: Path) -> Tuple[World, int]:
        try:
            return self.world(path)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self._trace(path)}") from None

    def _heal(self, world: World, path: Path) -> None:
        try:
            world.heal()
        except AssertionError as e:
            raise AssertionError(f"healing failed: {e}\n{self._trace(path)}") from None

    def _trace(self, path: Path) -> str:
        lines = [f"shape: {self.shape}", f"path: {list(path)}"]
        try:
            self.world(path, lines)
        except AssertionError:
            pass  # the trace ends with the event that failed
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"{self.states} states, {self.edges} edges, {self.cut} cut at depth {self.depth}, "
                f"{self.seconds:.1f} s; events: {dict(sorted(self.kinds.items()))}")
