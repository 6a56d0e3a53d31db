"""Export a race as a JSON trace, and load one back for replay without any model.

A trace holds each lane's events, the text each committed token added to the output (a tokenizer is
needed to split text into tokens, and a replay has none) and every other token's text on its own.
What the screen shows is derived from those when it is drawn, in the language of the moment.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

from specdec_core import SpecConfig
from specdec_core.config import MAX_K, MAX_TREE_NODES
from specdec_core.events import RoundEvent
from specdec_core.messages import cut

from .i18n import Said
from .race import Lane, Race

VERSION = 2
MAX_TRACE_BYTES = 5_000_000  # a real race's trace is well under 1 MB
MAX_TOP = 64  # rows of top-n probabilities an event may carry, and entries per row
# a replay lasts at most as long as a slow real race of its length: a lane's clock is clipped to this
PROMPT_S, S_PER_TOKEN = 5.0, 1.0


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


Step = tuple[str, RoundEvent, list[str], str]  # lane name, event, its committed tokens' texts, the tail if it ends


def from_trace(data: dict | str) -> tuple[Race, list[Step]]:
    """An empty Race and its timeline of steps, in shared-clock order. ValueError (Said) for anything else."""
    if isinstance(data, str) and len(data) > MAX_TRACE_BYTES:
        raise Said("trace_too_big", mb=MAX_TRACE_BYTES / 1e6)
    try:
        data = json.loads(data) if isinstance(data, str) else data
    except RecursionError:
        raise Said("trace_damaged", error="nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != "specdec-trace" or data.get("version") != VERSION:
        raise Said("trace_not", version=VERSION)
    try:
        cfg = SpecConfig(**data["settings"])
        labels = {int(k): str(v) for k, v in data["labels"].items()}
        timeline, lanes = [], {}
        for name in ("plain", "speculative"):
            events = [checked(RoundEvent.from_dict(e)) for e in data["lanes"][name]["events"]]
            if sum(len(e.committed) for e in events) > cfg.max_new_tokens:
                raise Said("trace_tokens", lane=name, n=cfg.max_new_tokens)
            lanes[name] = Lane(name, iter(()), None)
            texts, tail = [str(x) for x in data["lanes"][name]["texts"]], str(data["lanes"][name].get("tail", ""))
            if len(texts) != sum(len(e.committed) for e in events):
                raise Said("trace_texts", lane=name)
            for e in clipped(events):
                timeline.append((name, e, texts[: len(e.committed)], tail if e.finished else ""))
                texts = texts[len(e.committed):]
        meta = {str(k): v for k, v in dict(data.get("meta") or {}).items() if isinstance(v, (str, int, float, type(None)))}
    except Said:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as err:
        raise Said("trace_damaged", error=f"{err.__class__.__name__}: {err}") from None
    timeline.sort(key=lambda item: item[1].elapsed_s)
    race = Race(lanes["plain"], lanes["speculative"], cfg, labels=labels, meta=meta)
    return race, timeline


def checked(e: RoundEvent) -> RoundEvent:
    """`e` if its fields have the types, sizes, shapes and times a real round's have; else Said. Nothing of a trace
    reaches the page but what passes here (numbers as numbers, kinds among the known ones) and escaped text."""
    n = len(e.drafted)
    rows = e.target_top + e.draft_top + [e.residual_top or []]
    times = (e.elapsed_s, e.prefill_s, e.draft_s, e.verify_s, e.overhead_s, e.step_ms)
    probs = (*e.p_drafted, *e.q_drafted, *e.accept_probs, *e.uniforms, e.p_token, e.expected, *e.curve, e.gain,
             *(p for row in rows for _, p in row))
    integers = (*e.drafted, *e.committed, *e.parents, *e.path, e.token, e.round, e.k, e.accepted, e.n_generated,
                e.draft_steps, *(t for row in rows for t, _ in row))
    if (n > max(MAX_K, MAX_TREE_NODES) or len(e.committed) > n + 1 or len(e.parents) != n or len(e.path) > n
            or len(e.curve) > MAX_K + 1
            or len(rows) > 2 * MAX_TOP or any(len(row) > MAX_TOP for row in rows)
            or not all(type(t) is int and 0 <= t < 2**40 or t == -1 for t in integers)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                       for x in (*times, *probs))
            or any(len(v) != n for v in (e.p_drafted, e.q_drafted, e.accept_probs, e.uniforms))
            or not tree_shaped(e) or e.accepted != len(e.path) or e.round < 1
            or (e.method, e.token_kind) not in KINDS or e.finish_reason not in (None, "eos", "length")
            or not all(isinstance(b, bool) for b in (e.greedy, e.finished)) or not isinstance(e.drafter, str)):
        raise Said("trace_round", round=cut(str(e.round)))
    return e


KINDS = {("autoregressive", "target"), ("speculative", "replacement"), ("speculative", "bonus")}


def tree_shaped(e: RoundEvent) -> bool:
    """Parents before their children, and the path a line of nodes from the root, each the last one's child."""
    return (all(-1 <= parent < i for i, parent in enumerate(e.parents))
            and all(0 <= node < len(e.parents) and e.parents[node] == (e.path[j - 1] if j else -1)
                    for j, node in enumerate(e.path)))


def clipped(events: list[RoundEvent]):
    """The lane's events with their clock clipped to a slow real race's: PROMPT_S, then S_PER_TOKEN a token."""
    tokens, clock = 0, 0.0
    for e in events:
        tokens += len(e.committed)
        clock = max(clock, min(e.elapsed_s, PROMPT_S + S_PER_TOKEN * tokens))
        yield e if clock == e.elapsed_s else replace(e, elapsed_s=clock)


def replay_step(race: Race, item: Step) -> None:
    name, event, texts, tail = item
    lane = race.plain if name == "plain" else race.spec
    lane.events.append(event)
    lane.texts.extend(texts)
    lane.tail = tail
    lane.done = event.finished
