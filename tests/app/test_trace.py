"""Traces: export a race, load it back without a model, replay it to the same state; step captions."""
import dataclasses
import json

import pytest

from app.handlers import lane_pieces, view
from app.race import run, start_race
from app.teach import caption, inspect
from app.trace import from_trace, replay_step, to_trace
from specdec_core import SpecConfig
from specdec_core.events import chain


def test_trace_round_trips_exactly(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=3, max_new_tokens=30, temperature=0.8, seed=2)))
    data = json.loads(json.dumps(to_trace(race)))  # through JSON, as a file would
    replayed, timeline = from_trace(data)
    assert replayed.tokenizer is None
    for item in timeline:
        replay_step(replayed, item)
    for a, b in ((race.plain, replayed.plain), (race.spec, replayed.spec)):
        assert a.events == b.events and a.texts == b.texts and a.tail == b.tail and b.done
        assert lane_pieces(race, a) == lane_pieces(replayed, b)
    assert replayed.cfg == race.cfg and replayed.meta["prompt"] == "hello"
    # the replayed race renders and inspects with no model at all
    assert view(replayed).spec == view(race).spec and view(replayed, "pt").spec == view(race, "pt").spec
    text, _, _ = inspect(replayed, 1, 1)
    assert "Round 1" in text and "#" not in text.split("·")[0]
    assert [e.elapsed_s for _, e, _, _ in timeline] == sorted(e.elapsed_s for _, e, _, _ in timeline)


@pytest.mark.parametrize("bad", ["", "{}", '{"format": "specdec-trace", "version": 1}', "[1, 2]",
                                 '{"format": "other"}'])
def test_damaged_traces_are_refused_with_a_message(bad):
    with pytest.raises(ValueError, match="trace"):
        from_trace(bad if bad else "null")


def test_step_captions(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=4, max_new_tokens=40)))
    for e in race.spec.events:
        words = caption(e)
        assert f"drafted {len(e.drafted)}" in words and f"agreed with {e.accepted}" in words
        assert ("replaced" in words) == (e.token_kind == "replacement")
    e = dataclasses.replace(race.spec.events[0], drafted=[1, 2, 3, 4], draft_steps=2, gain=1.5)  # two drawn as guessed
    assert caption(e).startswith(f"Round {e.round}: drafted 4 in 2 draft steps (the policy expected 1.50× from it), "
                                 "the target agreed with")
    assert caption(e, "pt").startswith(f"Rodada {e.round}: rascunhou 4 em 2 passos do rascunho (a política esperava "
                                       "1.50× disso), o alvo concordou")


def test_the_shipped_trace_replays_without_a_model():
    from pathlib import Path

    data = (Path(__file__).resolve().parents[2] / "app" / "assets" / "trace-bundled-cpu.json").read_text()
    race, timeline = from_trace(data)
    for item in timeline:
        replay_step(race, item)
    assert race.done and race.identical is True and race.meta["pair"] == "bundled"
    assert race.spec.stats.tokens == race.plain.stats.tokens == 96
    assert "def is_prime" in "".join(p.text for p in lane_pieces(race, race.spec))
    # written before a chain was stored as a tree: each round reads as the one-branch tree it was
    assert all(e.parents == chain(len(e.drafted)) and e.path == list(range(e.accepted)) for e in race.spec.events)
    assert any(e.path for e in race.spec.events) and any(e.accepted < len(e.drafted) for e in race.spec.events)
