"""Two decoders racing on one device: each runs as its own generator of events with its own clock (stopped
while the other works), and the one behind on its clock goes next. So at any moment both stand at the same
point of a shared timeline, each charged only its own compute, as if it had the device to itself. The app's
race and the GPU bench's both run on this."""
from __future__ import annotations

from typing import Iterator

from .events import RoundEvent


def interleave(streams: dict[str, Iterator[RoundEvent]]) -> Iterator[tuple[str, RoundEvent]]:
    """(name, event) pairs from the named event streams, the stream with the least elapsed time next."""
    live, clocks = dict(streams), dict.fromkeys(streams, 0.0)
    while live:
        name = min(live, key=clocks.__getitem__)
        event = next(live[name], None)
        if event is None:
            del live[name]
            continue
        clocks[name] = event.elapsed_s
        yield name, event


def race(streams: dict[str, Iterator[RoundEvent]]) -> dict[str, list[RoundEvent]]:
    """Each stream's events, the streams run to their ends in the order interleave gives them."""
    events = {name: [] for name in streams}
    for name, event in interleave(streams):
        events[name].append(event)
    return events
