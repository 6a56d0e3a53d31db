"""Per-visitor limits for a public deployment: one generation at a time, and a token allowance."""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager

from .i18n import Said


def proxy_hops() -> int:
    """Trusted proxies in front of the app (SPECDEC_PROXY_HOPS; on Spaces 1, elsewhere 0)."""
    default = "1" if os.environ.get("SPACE_ID") else "0"
    return max(int(os.environ.get("SPECDEC_PROXY_HOPS", default) or 0), 0)


def visitor_of(request) -> str:
    """The client's address. Each trusted proxy appends the address it was called from to X-Forwarded-For, so
    the visitor's is the entry the outermost trusted proxy wrote, `hops` from the right; what lies left of it is
    whatever the client sent. With no trusted proxy, the connection's own address."""
    if request is None:
        return "local"
    hops = proxy_hops()
    headers = getattr(request, "headers", None) or {}
    # a proxy may add a header line of its own rather than append to the last: the lines read as one list, in order
    lines = headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else [headers.get("x-forwarded-for", "")]
    forwarded = [x.strip() for line in lines for x in line.split(",")]
    forwarded = [x for x in forwarded if x]
    if hops and forwarded:
        return forwarded[-min(hops, len(forwarded))]
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


class VisitorLimits:
    def __init__(self, tokens_per_hour: int, concurrent: int = 1, window_s: float = 3600.0,
                 max_prompt_tokens: int | None = None):
        self.tokens_per_hour, self.concurrent, self.window_s = tokens_per_hour, concurrent, window_s
        self.max_prompt_tokens = max_prompt_tokens  # a prompt is read whole before the first token: minutes, if long
        self._active: dict[str, int] = defaultdict(int)
        self._spent: dict[str, deque] = defaultdict(deque)  # (time, tokens) per visitor
        self._lock = threading.Lock()

    def check_prompt(self, tokens: int) -> None:
        if self.max_prompt_tokens is not None and tokens > self.max_prompt_tokens:
            raise Said("prompt_tokens", n=tokens, limit=self.max_prompt_tokens)

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
