"""Export a race as a JSON trace, and load one back for replay without any model.

A trace holds each lane's events, the text each committed token added to the output (a tokenizer is
needed to split text into tokens, and a replay has none) and every other token's text on its own.
What the screen shows is derived from those when it is drawn, in the language of the moment.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from specdec_core import SpecConfig
from specdec_core.events import RoundEvent

from .i18n import Said
from .race import Lane, Race

VERSION = 2
COMMITTED_KINDS = ("accepted", "replacement", "bonus", "target")  # version 1 pieces that carried output text


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
    lanes = {lane.name: {"events": [e.to_dict() for e in lane.events], "texts": lane.texts, "tail": lane.tail}
             for lane in (race.plain, race.spec)}
    return {"format": "specdec-trace", "version": VERSION, "meta": race.meta, "settings": asdict(race.cfg),
            "labels": {str(k): v for k, v in race.labels.items()}, "lanes": lanes}


def lane_texts(lane: dict, events: list[RoundEvent]) -> tuple[list[str], str]:
    """(texts, tail) of a lane; version 1 traces stored pieces, whose committed ones carry the texts."""
    if "texts" in lane:
        return [str(x) for x in lane["texts"]], str(lane.get("tail", ""))
    texts = [p["text"] for p in lane["pieces"] if p["kind"] in COMMITTED_KINDS]
    n = sum(len(e.committed) for e in events)
    return texts[:n], "".join(texts[n:])  # a text past the last token is the held-back tail


Step = tuple[str, RoundEvent, list[str], str]  # lane name, event, its committed tokens' texts, the tail if it ends


def from_trace(data: dict | str) -> tuple[Race, list[Step]]:
    """An empty Race and its timeline of steps, in shared-clock order."""
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict) or data.get("format") != "specdec-trace" or data.get("version") not in (1, VERSION):
        raise Said("trace_not", version=VERSION)
    try:
        cfg = SpecConfig(**data["settings"])
        labels = {int(k): str(v) for k, v in data["labels"].items()}
        timeline, lanes = [], {}
        for name in ("plain", "speculative"):
            events = [RoundEvent.from_dict(e) for e in data["lanes"][name]["events"]]
            lanes[name] = Lane(name, iter(()), None)
            texts, tail = lane_texts(data["lanes"][name], events)
            for e in events:
                timeline.append((name, e, texts[: len(e.committed)], tail if e.finished else ""))
                texts = texts[len(e.committed):]
    except (KeyError, TypeError, ValueError) as err:
        raise Said("trace_damaged", error=str(err)) from None
    timeline.sort(key=lambda item: item[1].elapsed_s)
    race = Race(lanes["plain"], lanes["speculative"], cfg, labels=labels, meta=dict(data.get("meta") or {}))
    return race, timeline


def replay_step(race: Race, item: Step) -> None:
    name, event, texts, tail = item
    lane = race.plain if name == "plain" else race.spec
    lane.events.append(event)
    lane.texts.extend(texts)
    lane.tail = tail
    lane.done = event.finished
