"""Handlers for the teaching tools: inspector, theory and sweep, step mode, trace export and replay."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import gradio as gr

from . import plots
from .handlers import empty_view, make_config, view
from .inspector import decision_figure, decision_text, theory_figure
from .race import run, start_race, step
from .render import message_html
from .trace import from_trace, replay_step, to_trace

ORDINAL = {1: "1st", 2: "2nd", 3: "3rd"}


def inspect(race, round_no, position):
    if race is None or not race.spec.events:
        return message_html("Run a generation first, then pick a round and a position.", "info"), plots._fig("")
    events = race.spec.events
    e = events[min(max(int(round_no or 1), 1), len(events)) - 1]
    i = min(max(int(position or 1), 1), len(e.drafted) + 1) - 1
    head = f"Round {e.round} of {len(events)} · position {i + 1} of {len(e.drafted) + 1}. "
    return message_html(head + decision_text(e, i, race.label), "info"), decision_figure(e, i, race.label)


def theory(race):
    if race is None or not race.done:
        return plots._fig("Run a generation to fill the model with measured numbers")
    return theory_figure(race.plain.stats, race.spec.stats, race.cfg.k)


def caption(e) -> str:
    words = f"Round {e.round}: drafted {len(e.drafted)}, the target agreed with {e.accepted}"
    if e.token_kind == "replacement":
        words += f", replaced the {ORDINAL.get(e.accepted + 1, f'{e.accepted + 1}th')}"
    elif e.token_kind == "bonus":
        words += ", and added a bonus token"
    return words + f", kept {len(e.committed)} token{'s' if len(e.committed) != 1 else ''}."


def step_round(manager, race, prompt, k, temperature, top_p, top_k, max_new_tokens, seed, drafter, adaptive,
               min_confidence):
    """One speculative round per click (plain decoding keeps pace on the shared clock)."""
    pair = manager.pair
    try:
        if race is None or race.done or race.tokenizer is None or race.meta.get("prompt") != prompt:
            if pair is None:
                raise ValueError("No model is loaded yet.")
            cfg = make_config(k, temperature, top_p, top_k, max_new_tokens, seed, adaptive, min_confidence)
            race = start_race(pair, prompt, cfg, drafter)
        before = len(race.spec.events)
        while len(race.spec.events) == before and step(race):
            pass
    except ValueError as err:
        return empty_view(str(err))
    outputs = view(race, True)
    note = message_html(caption(race.spec.events[-1]), "info") if race.spec.events else ""
    return (*outputs[:2], outputs[2] + note, *outputs[3:])


def sweep(manager, prompt, k, temperature, top_p, top_k, max_new_tokens, seed, drafter, adaptive, min_confidence):
    """Run the prompt for K = 1..8 and plot measured against predicted speedup."""
    pair = manager.pair
    if pair is None:
        yield message_html("No model is loaded yet.", "error"), gr.skip()
        return
    points, last = [], None
    try:
        for kk in range(1, 9):
            yield message_html(f"Sweep: running K = {kk} of 8…", "info"), gr.skip()
            cfg = make_config(kk, temperature, top_p, top_k, min(int(max_new_tokens), 64), seed, False)
            race = run(start_race(pair, prompt, cfg, drafter))
            points.append((kk, race.spec.stats.decode_tokens_per_s / race.plain.stats.decode_tokens_per_s))
            last = last or race
    except ValueError as err:
        yield message_html(str(err), "error"), gr.skip()
        return
    best = max(points, key=lambda p: p[1])
    yield (message_html(f"Sweep done: fastest at K = {best[0]} ({best[1]:.2f}×). The curves use K = 1's "
                        "measured acceptance and costs.", "info"),
           theory_figure(last.plain.stats, last.spec.stats, 1, sweep=points))


def export(race):
    if race is None or not race.done:
        raise gr.Error("Finish a generation first; then its trace can be exported.")
    path = Path(tempfile.mkdtemp()) / f"specdec-trace-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(to_trace(race)))
    return str(path)


def replay(file, speed: float = 1.0):
    """Play a recorded trace at its measured timestamps (divided by `speed`); no model is needed."""
    try:
        race, timeline = from_trace(Path(file).read_text() if file else "")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        yield empty_view(f"Cannot replay: {err}")
        return
    start, last_plots = time.monotonic(), 0.0
    for item in timeline:
        wait = item[1].elapsed_s / max(float(speed or 1.0), 0.01) - (time.monotonic() - start)
        if wait > 0:
            time.sleep(wait)
        replay_step(race, item)
        now = time.monotonic()
        due = now - last_plots > 0.6
        last_plots = now if due else last_plots
        yield view(race, due)
    yield view(race, True)
