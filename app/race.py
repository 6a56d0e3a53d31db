"""The race: plain and speculative decoding of the same prompt, interleaved on one device.

Each decoder runs as an event generator with its own clock, which stops while the other one
works. The driver always advances the decoder whose clock is behind, so what the audience sees at
any moment is both decoders at the same point of a shared virtual timeline: each is charged only
its own compute, as if it had the device to itself.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterator

from specdec_core import SpecConfig, autoregressive_generate, make_drafter, speculative_generate, summarize
from specdec_core.drafters import DRAFTERS
from specdec_core.engine import encode_request
from specdec_core.events import Prefilling, RoundEvent, Stats
from specdec_core.models import dtype_name, first_divergence
from specdec_core.models.load import release_freed_memory
from specdec_core.race import interleave
from specdec_core.text import Detokenizer, token_text


@dataclass
class Lane:
    name: str
    stream: Iterator[RoundEvent]
    detok: Detokenizer | None  # None for a replayed trace, whose texts came with it
    events: list[RoundEvent] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the text each committed token added to the output
    tail: str = ""  # text held back until the end (a character its last token left incomplete)
    done: bool = False
    prefilling: Prefilling | None = None  # how far through the prompt, before the first round

    @property
    def stats(self) -> Stats | None:
        return summarize(self.events) if self.events else None

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.committed]


@dataclass
class Race:
    plain: Lane
    spec: Lane
    cfg: SpecConfig
    tokenizer: object = None  # None for a replayed trace, whose labels came with it
    labels: dict[int, str] = field(default_factory=dict)  # token id -> its text on its own (inspector, traces)
    meta: dict = field(default_factory=dict)  # pair, device, dtype, drafter, prompt
    compare: object = None  # (plain ids, speculative ids) -> models.first_divergence's dict; None for a trace
    order: Iterator[tuple[str, RoundEvent]] | None = None  # the lanes' events in race order (race.interleave)
    _parted: tuple | None = None

    def label(self, token: int) -> str:
        if token not in self.labels:
            self.labels[token] = token_text(self.tokenizer, token) if self.tokenizer is not None else f"#{token}"
        return self.labels[token]

    @property
    def done(self) -> bool:
        return self.plain.done and self.spec.done

    @property
    def identical(self) -> bool | None:
        """Greedy runs must match token for token; sampled runs are equal in distribution only."""
        return self.plain.token_ids == self.spec.token_ids if self.cfg.greedy and self.done else None

    @property
    def parted(self) -> tuple[int, str, float, str, float] | None:
        """Where finished greedy outputs that differ part: the position, each decoder's token and the target's
        logit for it (one target pass, computed once)."""
        d = None
        if self.identical is False and self.compare is not None and self._parted is None:
            d = self.compare(self.plain.token_ids, self.spec.token_ids)
        if d is not None:
            self._parted = (d["position"], self.label(d["ar_token"]), d["ar_logit"], self.label(d["spec_token"]),
                            d["spec_logit"])
        return self._parted


def start_race(pair, prompt: str, cfg: SpecConfig, drafter: str = DRAFTERS[0], plain: bool = True) -> Race:
    """Validate everything up front (raising ValueError with a message) before any compute starts."""
    ids = encode_request(pair, prompt, cfg)
    pair.read_heads()  # the chat heads both decoders copy, read before either starts: neither is charged for them
    spec = Lane("speculative", speculative_generate(pair, ids, cfg, make_drafter(pair, drafter, cfg), progress=True),
                Detokenizer(pair.tokenizer, skip_special_tokens=True))
    lane = Lane("plain", autoregressive_generate(pair, ids, cfg, progress=True),
                Detokenizer(pair.tokenizer, skip_special_tokens=True))
    lane.done = not plain
    meta = {"pair": pair.name, "target": pair.info.target, "draft": pair.info.draft, "drafter": drafter,
            "device": str(pair.device), "dtype": dtype_name(pair.dtype), "prompt": prompt, "prompt_tokens": len(ids)}
    order = interleave({one.name: one.stream for one in (lane, spec) if not one.done})
    held = weakref.ref(pair)  # a race kept in a visitor's state must not keep a pair the server has since replaced
    return Race(lane, spec, cfg, pair.tokenizer, meta=meta, compare=lambda a, b: first_divergence(held(), ids, a, b)
                if held() is not None else None, order=order)


def advance(race: Race) -> Lane | None:
    """Advance the decoder that is behind on the shared clock by one event; None when both are done."""
    name, event = next(race.order, (None, None)) if race.order is not None else (None, None)
    if event is None:
        return None
    lane = race.plain if name == race.plain.name else race.spec
    if isinstance(event, Prefilling):
        lane.prefilling = event
        return lane
    lane.events.append(event)
    lane.texts.extend(lane.detok.add(token) for token in event.committed)
    if event.finished:
        lane.tail = lane.detok.flush()
    lane.done = event.finished
    return lane


def stop(race: Race) -> None:
    """End a race's decoders where they stand: their caches freed now, not when the race is, and the heap they held
    given back to the system."""
    for lane in (race.plain, race.spec):
        getattr(lane.stream, "close", lambda: None)()
    race.order = None
    release_freed_memory()


def run(race: Race) -> Race:
    while advance(race):
        pass
    return race
