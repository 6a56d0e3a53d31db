"""Export a race as a JSON trace, and load one back for replay without any model."""
from __future__ import annotations

import json
from dataclasses import asdict

from specdec_core import SpecConfig
from specdec_core.events import RoundEvent

from .race import Lane, Race
from .render import Piece

VERSION = 1


def token_ids(events: list[RoundEvent]):
    for e in events:
        yield from e.drafted
        yield from e.committed
        yield e.token
        for row in e.target_top + e.draft_top + [e.residual_top or []]:
            yield from (t for t, _ in row)


def to_trace(race: Race) -> dict:
    for lane in (race.plain, race.spec):
        for t in token_ids(lane.events):
            race.label(t)
    lanes = {lane.name: {"events": [e.to_dict() for e in lane.events], "pieces": [asdict(p) for p in lane.pieces]}
             for lane in (race.plain, race.spec)}
    return {"format": "specdec-trace", "version": VERSION, "meta": race.meta, "settings": asdict(race.cfg),
            "labels": {str(k): v for k, v in race.labels.items()}, "lanes": lanes}


def from_trace(data: dict | str) -> tuple[Race, list[tuple[str, RoundEvent, list[Piece]]]]:
    """An empty Race and its timeline: (lane name, event, that round's pieces) in shared-clock order."""
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict) or data.get("format") != "specdec-trace" or data.get("version") != VERSION:
        raise ValueError("This file is not a specdec trace (version 1).")
    try:
        cfg = SpecConfig(**data["settings"])
        labels = {int(k): str(v) for k, v in data["labels"].items()}
        timeline = []
        lanes = {}
        for name in ("plain", "speculative"):
            lane = data["lanes"][name]
            events = [RoundEvent.from_dict(e) for e in lane["events"]]
            pieces = [Piece(**p) for p in lane["pieces"]]
            lanes[name] = Lane(name, iter(()), None)
            for e in events:
                timeline.append((name, e, [p for p in pieces if p.round == e.round]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"The trace is damaged: {err}") from None
    timeline.sort(key=lambda item: item[1].elapsed_s)
    race = Race(lanes["plain"], lanes["speculative"], cfg, labels=labels, meta=dict(data.get("meta") or {}))
    return race, timeline


def replay_step(race: Race, item: tuple[str, RoundEvent, list[Piece]]) -> None:
    name, event, pieces = item
    lane = race.plain if name == "plain" else race.spec
    lane.events.append(event)
    lane.pieces.extend(pieces)
    lane.done = event.finished
