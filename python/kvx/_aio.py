"""The last step of kvx's awaitables that hand over what must not be lost (``Receiver.ready``'s
leases, ``Receiver.returned_async``'s returns).

kvx's runtime finishes the Rust side on its own threads and passes the result to the event
loop. Were the result the leases themselves, an await cancelled after they were taken and
before the loop ran would drop them unread. So the result is a native ``Delivery`` holding
them, which a task of the loop opens only once it has resumed with it; a ``Delivery``
dropped unopened (the await was cancelled) hands what it holds back to the receiver, for the
next call.
"""

import asyncio
from typing import Any, Awaitable


def delivered(future: "asyncio.Future[Any]") -> "asyncio.Future[Any]":
    """A task of the running loop whose result is what ``future``'s ``Delivery`` holds, as
    Python objects (a future, as kvx's other awaitables are: cancel it, wait on it)."""
    return asyncio.ensure_future(_opened(future))


async def _opened(future: Awaitable[Any]) -> Any:
    return (await future).take()
