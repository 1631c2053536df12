"""What the tests' two-sided stand-ins for kvx (``loopback``, ``swarm``) share: the parts of
``KvTransfer`` an end has nothing to say in, and handing over the events an end collected."""

from __future__ import annotations

from typing import Any, Dict

from kvx.vllm.transfer import TransferEvents


class QuietEnd:
    """No counts to report and nothing to close."""

    def take_counts(self) -> Dict[str, int]:
        return {}

    def close(self) -> None:
        return None


def take_events(holder: Any, name: str) -> TransferEvents:
    """``holder.<name>``'s events, leaving a fresh empty set in their place."""
    events = getattr(holder, name)
    setattr(holder, name, TransferEvents())
    return events
