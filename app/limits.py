"""Per-visitor limits for a public deployment: one generation at a time, and a token allowance."""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager

from .i18n import Said


def visitor_of(request) -> str:
    """The client's address (first hop of X-Forwarded-For behind a proxy such as Spaces)."""
    if request is None:
        return "local"
    forwarded = (getattr(request, "headers", None) or {}).get("x-forwarded-for", "")
    if forwarded:
        return forwarded.split(",")[0].strip()
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


class VisitorLimits:
    def __init__(self, tokens_per_hour: int, concurrent: int = 1, window_s: float = 3600.0):
        self.tokens_per_hour, self.concurrent, self.window_s = tokens_per_hour, concurrent, window_s
        self._active: dict[str, int] = defaultdict(int)
        self._spent: dict[str, deque] = defaultdict(deque)  # (time, tokens) per visitor
        self._lock = threading.Lock()

    @contextmanager
    def admit(self, visitor: str, tokens: int):
        """Charge `tokens` (both decoders' maximum) up front; ValueError with the reason when refused."""
        with self._lock:
            now, spent = time.monotonic(), self._spent[visitor]
            while spent and now - spent[0][0] > self.window_s:
                spent.popleft()
            if self._active[visitor] >= self.concurrent:
                raise Said("one_at_a_time")
            used = sum(t for _, t in spent)
            if used + tokens > self.tokens_per_hour:
                raise Said("allowance", limit=self.tokens_per_hour, used=used)
            self._active[visitor] += 1
            spent.append((now, tokens))
        try:
            yield
        finally:
            with self._lock:
                self._active[visitor] -= 1
