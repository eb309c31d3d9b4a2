"""A server-wide budget of bytes in flight, shared by all requests (request bodies, decoded images).

A request reserves what it will hold before it holds it and gives it back when it is done. When
the budget is spent, reservations wait in arrival order (a large request is not starved by a
stream of small ones) for at most ``timeout_s`` seconds; past that the request is refused with 503
and a ``Retry-After`` header, which the ``remote`` reward honours. A reservation larger than the
whole budget is cut to the budget: such a request runs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from .codec import MIB, RequestError

#: seconds a refused request is told to wait before it tries again (503 Retry-After)
RETRY_AFTER_S = 2


class ByteBudget:
    """At most ``capacity`` bytes reserved at once; ``what`` names the budget in the 503 reason and
    ``option`` the server option that sets it. ``peak`` is the most ever reserved at once."""

    def __init__(self, capacity: int, timeout_s: float, what: str, option: str):
        self.capacity = max(1, int(capacity))
        self.timeout_s = float(timeout_s)
        self.what, self.option = what, option
        self.used = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int):
        """``async with budget.reserve(n):`` holds ``min(n, capacity)`` bytes of the budget inside."""
        n = min(max(0, int(nbytes)), self.capacity)
        await self._acquire(n)
        try:
            yield
        finally:
            self._release(n)

    async def _acquire(self, n: int) -> None:
        if not self._waiters and self.used + n <= self.capacity:
            self._take(n)
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, self.timeout_s)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self._release(n)  # granted in the instant we gave up: give it back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()  # those behind a large request that left may fit now
            if isinstance(exc, asyncio.TimeoutError):
                raise RequestError(503, f"the server is busy: {self.what} in flight already use "
                                        f"{self.used / MIB:.0f} of {self.capacity / MIB:g} MiB ({self.option}) and "
                                        f"this request waited {self.timeout_s:g} s (queue_timeout_s); retry later",
                                   headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            raise

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        """Hand the budget to the waiters at the head of the queue, in order, while they fit."""
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
