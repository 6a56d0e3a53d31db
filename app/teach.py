"""Handlers for the teaching tools: inspector, theory and sweep, step mode, trace export and replay."""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import gradio as gr

from . import plots
from .handlers import empty_view, view
from .i18n import Said, code, said, t
from .inspector import decision_figure, decision_text, sweep_figure, theory_figure, tree_theory_figure, where_text
from .race import advance, run, start_race
from .render import message_html
from .settings import ask
from .trace import MAX_TRACE_BYTES, from_trace, replay_step, to_trace
from .tree import tree_html


def inspect(race, round_no, position, lang="en"):
    if race is None or not race.spec.events:
        return message_html(t("pick_first", lang), "info"), plots._fig(""), gr.skip()
    events = race.spec.events
    e = events[min(max(int(round_no or 1), 1), len(events)) - 1]
    i = min(max(int(position or 1), 1), len(e.drafted) + 1) - 1
    head = where_text(e, i, len(events), lang)
    return (message_html(head + decision_text(e, i, race.label, lang), "info"), decision_figure(e, i, race.label, lang),
            tree_html(e, race.label, lang) if e.drafted else gr.skip())


def pick(race, picked: str, lang="en"):
    """A click on a token or a tree's node (CLICK_JS writes "round,position,nonce"): open the inspector there."""
    try:
        round_no, position = (int(x) for x in (picked or "").split(",")[:2])
    except ValueError:
        return (gr.skip(),) * 6
    return (gr.Accordion(open=True), round_no, position, *inspect(race, round_no, position, lang))


def theory(race, lang="en"):
    if race is None or not race.done:
        return plots._fig(t("f_theory_empty", lang))
    if race.cfg.tree_nodes:
        return tree_theory_figure(race.spec.events, lang)
    policy = next((e for e in reversed(race.spec.events) if e.curve), None)
    return theory_figure(race.plain.stats, race.spec.stats, race.cfg.k, lang, policy)


def caption(e, lang="en") -> str:
    if e.plain_step:  # and why
        return t("caption_plain", lang, r=e.round, g=e.gain)
    # where guesses (or a tree's levels) spared the draft some steps, say how many it took
    steps = t("caption_steps", lang, s=e.draft_steps) if 0 < e.draft_steps < len(e.drafted) else ""
    gain = t("caption_gain", lang, g=e.gain) if e.gain else ""
    words = t("caption", lang, r=e.round, d=len(e.drafted), steps=steps, gain=gain, a=e.accepted)
    if e.token_kind == "replacement":
        n = e.accepted + 1
        nth = f"{n}º" if code(lang) == "pt" else {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
        words += t("caption_replaced", lang, nth=nth)
    elif e.token_kind == "bonus":
        words += t("caption_bonus", lang)
    return words + t("caption_kept", lang, n=len(e.committed), s="" if len(e.committed) == 1 else "s")


def step_round(manager, race, prompt, settings: dict):
    """One speculative round per click (plain decoding keeps pace on the shared clock)."""
    pair = manager.pair
    try:
        wanted = ask(settings)
        if race is None or race.done or race.tokenizer is None or race.meta.get("prompt") != prompt:
            if pair is None:
                raise Said("no_model")
            race = start_race(pair, prompt, wanted.cfg, wanted.drafter)
        before = len(race.spec.events)
        while len(race.spec.events) == before and advance(race):
            pass
    except ValueError as err:
        return empty_view(said(err, settings.get("lang") or "en"))
    shown = view(race, wanted.lang)
    note = message_html(caption(race.spec.events[-1], wanted.lang), "info") if race.spec.events else ""
    return shown._replace(summary=shown.summary + note)


SWEEP_TEMPERATURES = (0.7, 1.0)


def sweep(manager, prompt, settings: dict, temperatures=False):
    """For the chosen temperature (and 0.7 and 1.0 if asked), run plain decoding once and speculative decoding
    for K = 1..8 (up to 64 tokens each, no confidence cut); plot measured against predicted speedup."""
    pair = manager.pair
    lang = settings.get("lang") or "en"
    if pair is None:
        yield message_html(t("no_model", lang), "error"), gr.skip()
        return
    series, done = [], 0
    try:
        wanted = ask(settings)
        base = dataclasses.replace(wanted.cfg, max_new_tokens=min(wanted.cfg.max_new_tokens, 64), adaptive=False,
                                   min_confidence=0.0, record_top=0)
        temps = list(dict.fromkeys([base.temperature, *(SWEEP_TEMPERATURES if temperatures else ())]))
        for temp in temps:
            points, plain, first = [], None, None
            for kk in range(1, 9):
                done += 1
                yield message_html(t("sweep_running", lang, temp=temp, k=kk, done=done, total=8 * len(temps)),
                                   "info"), gr.skip()
                cfg = dataclasses.replace(base, k=kk, temperature=temp)
                race = run(start_race(pair, prompt, cfg, wanted.drafter, plain=kk == 1))  # plain decoding once
                plain, first = plain or race.plain.stats, first or race.spec.stats
                points.append((kk, race.spec.stats.decode_tokens_per_s / plain.decode_tokens_per_s))
            series.append((temp, plain, first, points))
    except ValueError as err:
        yield message_html(said(err, lang), "error"), gr.skip()
        return
    best = max(((temp, kk, x) for temp, _, _, points in series for kk, x in points), key=lambda b: b[2])
    yield message_html(t("sweep_done", lang, k=best[1], temp=best[0], x=best[2]), "info"), sweep_figure(series, lang)


def export(race, lang: str = "en"):
    if race is None or not race.done:
        raise gr.Error(t("export_first", lang))
    path = Path(tempfile.mkdtemp()) / f"specdec-trace-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(to_trace(race)))
    return str(path)


MAX_REPLAY_S = 120.0  # a replay's wall time, at any speed: past it, the rest of the trace is shown at once


def replay(file, speed: float = 1.0, lang: str = "en"):
    """Play a recorded trace at its measured timestamps (divided by `speed`), for MAX_REPLAY_S at most; no model is
    needed."""
    try:
        if file and Path(file).stat().st_size > MAX_TRACE_BYTES:  # refused before it is read
            raise Said("trace_too_big", mb=MAX_TRACE_BYTES / 1e6)
        race, timeline = from_trace(Path(file).read_text() if file else "")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        yield empty_view(t("replay_failed", lang, reason=said(err, lang)))
        return
    start, last_plots = time.monotonic(), 0.0
    for item in timeline:
        wait = item[1].elapsed_s / min(max(float(speed or 1.0), 0.25), 8.0) - (time.monotonic() - start)
        wait = min(wait, MAX_REPLAY_S - (time.monotonic() - start))
        if wait > 0:
            time.sleep(wait)
        replay_step(race, item)
        now = time.monotonic()
        due = now - last_plots > 0.6
        last_plots = now if due else last_plots
        yield view(race, lang, due)
    yield view(race, lang)
