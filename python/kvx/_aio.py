"""The last step of kvx's awaitables that hand over what must not be lost (``Receiver.ready``'s
leases, ``Receiver.returned_async``'s returns).

kvx's runtime finishes the Rust side on its own threads and passes the result to the event
loop. Were the result the leases themselves, an await cancelled after they were taken and
before the loop ran would drop them unread. So the result is a native ``Delivery`` holding
them, which this coroutine opens only once it has resumed with it; a ``Delivery`` dropped
unopened (the await was cancelled) hands what it holds back to the receiver, for the next
call.
"""

from typing import Any, Awaitable


async def delivered(future: Awaitable[Any]) -> Any:
    """What ``future``'s ``Delivery`` holds, as Python objects."""
    return (await future).take()
