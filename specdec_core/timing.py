"""Timing: a decoder's own clock, and passes of a pair's models timed on the device they run on.

Below the engine and the models: the engine charges each round to its Clock, a pair times its passes with
`tree_costs` (Pair.costs), the benches read `passes_ms` and `contexts_ms`. A pair is used
through `pair.cached(role)` only, so nothing here imports the models.
"""
from __future__ import annotations

import statistics
import time

import torch

from .theory import PassCosts


class Clock:
    """This decoder's own compute time: it stops while the consumer of the events holds control,
    so two decoders interleaved on one device are each charged only their own work.

    On CUDA the parts of a round are timed with events, read once the round's one transfer to the
    host has synchronised anyway, so timing adds no stall of its own.
    """

    def __init__(self, device: torch.device):
        kind = torch.device(device).type
        self.cuda = kind == "cuda"
        self._sync = torch.mps.synchronize if kind == "mps" else None
        self.elapsed, self._t = 0.0, time.perf_counter()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self._sync:
            self._sync()
        return time.perf_counter()

    def between(self, a, b) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    def lap(self, sync: bool = False) -> float:
        """Seconds since the last lap; `sync` waits for the device first (rounds need not: their read did)."""
        if sync and self.cuda:
            torch.cuda.synchronize()
        elif self._sync:
            self._sync()
        now = time.perf_counter()
        d, self._t = now - self._t, now
        self.elapsed += d
        return d

    def resume(self) -> None:
        self._t = time.perf_counter()


def pass_ms(pair, role: str, context: int, n: int, reps: int = 10) -> float:
    """Median milliseconds of an n-token pass of the target or the draft after `context` tokens."""
    return passes_ms(pair, role, context, (n,), reps)[n]


def prompt_ms(pair, role: str, length: int) -> float:
    """Milliseconds to take a prompt of `length` tokens into a fresh cache of the target or the draft, timed once
    (a long prompt takes seconds)."""
    lm, ids = pair.cached(role), list(range(1, length + 1))
    return median_ms(lambda: lm.prefill(ids), lm.device, reps=1, warm=0)


def median_ms(run, device, reps: int = 10, warm: int = 3) -> float:
    """Median milliseconds of `run()` on `device` over `reps` calls, after `warm` that warm up (and compile, when
    compiled)."""
    clock, times = Clock(device), []
    for _ in range(reps + warm):
        clock.lap(sync=True)
        run()
        times.append(clock.lap(sync=True))
    return statistics.median(times[warm:]) * 1000


def passes_ms(pair, role: str, context: int, sizes, reps: int = 10, warm: int = 3) -> dict[int, float]:
    """pass_ms for several sizes, after one prefill: {n: median milliseconds}."""
    return contexts_ms(pair, role, (context,), sizes, reps, warm)[context]


def contexts_ms(pair, role: str, contexts, sizes, reps: int = 10, warm: int = 3) -> dict[int, dict[int, float]]:
    """Passes of each size after each context length, {context: {n: median milliseconds}}, the calls interleaved
    (every context and size once a repetition): a slow spell of the machine then weighs on each alike, and their
    ratios hold where two timings of the same pass, a minute apart, differ by half."""
    lms = {}
    for context in contexts:
        lms[context] = pair.cached(role)
        lms[context].prefill(list(range(1, context)))
    device = next(iter(lms.values())).device
    clock, times = Clock(device), {(c, n): [] for c in contexts for n in sizes}
    inputs = {n: torch.ones(n, dtype=torch.long, device=device) for n in sizes}
    for rep in range(warm + reps):
        for context, lm in lms.items():
            for n in sizes:
                clock.lap(sync=True)
                lm.forward(inputs[n], keep=n)
                spent = clock.lap(sync=True)
                lm.crop(context - 1)
                if rep >= warm:
                    times[context, n].append(spent)
    return {c: {n: statistics.median(times[c, n]) * 1000 for n in sizes} for c in contexts}


# the target's passes timed at a pair's first race; larger ones follow the last two sizes' slope (PassCosts.verify), as a
# CPU's passes do past 16 rows (docs/benchmarks.md#token-trees-and-sampling: what timing 65 rows too cost and changed)
TREE_PASS_SIZES = (1, 2, 4, 8, 16, 32)


def tree_costs(pair, context: int = 128) -> PassCosts:
    """What sizes drafts on this device: target passes of 1..32 tokens and a draft forward of one token, relative to
    the target's one-token step, timed now (Pair.costs times them once and keeps them), after `context` tokens, or
    fewer where a static cache (a GPU's compiled steps) would not hold the passes after them."""
    static = pair.compiled.get("target")
    if static is not None:
        context = max(2, min(context, static.max_len - 2 * TREE_PASS_SIZES[-1]))
    ms = passes_ms(pair, "target", context, TREE_PASS_SIZES, reps=3, warm=1)
    draft = passes_ms(pair, "draft", context, (1,), reps=9, warm=2)[1] / ms[1] if pair.draft is not None else 0.0
    return PassCosts({n: t / ms[1] for n, t in ms.items()}, draft, ms[1])
