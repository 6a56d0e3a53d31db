"""Event handlers: generators that turn a race into UI outputs. No Gradio layout here."""
from __future__ import annotations

import time
from contextlib import contextmanager

import gradio as gr

from specdec_core import SpecConfig
from specdec_core.events import Stats
from specdec_core.sampling import NonFiniteLogitsError

from . import plots
from .i18n import t
from .limits import visitor_of
from .race import Race, run, start_race, step
from .render import message_html, pane_html

UI_EVERY_S, PLOTS_EVERY_S = 0.12, 1.0  # streaming cadence: text often, figures less often (CPU they share)

try:  # on Hugging Face Spaces (ZeroGPU) a GPU is attached only inside decorated calls
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:
    def on_gpu(fn):
        return fn


def make_config(k, temperature, top_p, top_k, max_new_tokens, seed, adaptive=False, min_confidence=0.0) -> SpecConfig:
    """UI/API values -> SpecConfig; raises ValueError with a readable message."""
    for name, value in (("k", k), ("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed)):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{name} is missing.")
    return SpecConfig(k=k, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                      seed=seed, adaptive=bool(adaptive), min_confidence=min_confidence or 0.0)


def figures(race: Race, plain: Stats | None, spec: Stats | None):
    lang = race.meta.get("lang", "en")
    return (plots.race_figure(race.plain.events, race.spec.events, lang),
            plots.speed_figure(plain, spec, lang),
            plots.rounds_figure(race.spec.events, lang),
            plots.position_figure(spec, lang))


def view(race: Race, with_plots: bool, note: str = ""):
    """Every output of the race, in the order the UI lists them."""
    plain, spec = race.plain.stats, race.spec.stats  # summarised once per update: this runs beside the models
    lang = race.meta.get("lang", "en")
    summary = plots.summary_html(plain, spec, race.identical, not race.done, lang)
    panes = (pane_html(race.plain.pieces, t("waiting", lang)), pane_html(race.spec.pieces, t("waiting", lang)))
    figs = figures(race, plain, spec) if with_plots else (gr.skip(),) * 4
    return (*panes, summary + (message_html(note, "error") if note else ""), *figs, race)


def empty_view(message: str, kind: str = "error"):
    """Leave the panes as they are and say what is wrong."""
    return (gr.skip(), gr.skip(), message_html(message, kind), *(gr.skip(),) * 4, gr.skip())


@contextmanager
def admitted(limits, request, cfg: SpecConfig):
    if limits is None:
        yield
    else:
        with limits.admit(visitor_of(request), 2 * cfg.max_new_tokens):  # both decoders
            yield


def race_stream(manager, limits, prompt, k, temperature, top_p, top_k, max_new_tokens, seed, drafter, adaptive,
                min_confidence, request: gr.Request = None, lang: str = "en"):
    """Generator for the Generate button: yields the panes, summary and figures as the race runs."""
    pair = manager.pair  # this run keeps this pair even if another one is loaded meanwhile
    if pair is None:
        yield empty_view(manager.status if manager.loading else "No model is loaded: pick a pair and press Load.",
                         "info")
        return
    try:
        cfg = make_config(k, temperature, top_p, top_k, max_new_tokens, seed, adaptive, min_confidence)
        race = start_race(pair, prompt, cfg, drafter)
        race.meta["lang"] = lang
        with admitted(limits, request, cfg):
            yield from _drive(race)
    except ValueError as err:
        yield empty_view(str(err))


@on_gpu
def _drive(race: Race):
    last_ui = last_plots = 0.0
    try:
        while step(race):
            now = time.monotonic()
            if now - last_ui >= UI_EVERY_S:
                plots_due = now - last_plots >= PLOTS_EVERY_S
                yield view(race, plots_due)
                last_ui, last_plots = now, now if plots_due else last_plots
    except NonFiniteLogitsError as err:
        yield view(race, True, f"Stopped: {err}. Try float32 or bfloat16 instead of float16.")
        return
    except Exception as err:  # out of memory, a broken checkpoint...: say so, keep serving
        yield view(race, True, f"Stopped: the generation failed ({err.__class__.__name__}: {err}).")
        return
    yield view(race, True)


def api_generate(manager, limits, prompt, k, temperature, top_p, top_k, max_new_tokens, seed, drafter,
                 min_confidence=0.0, request=None) -> dict:
    """Runs plain and speculative decoding and returns both texts and their statistics."""
    pair = manager.pair
    if pair is None:
        raise gr.Error("No model is loaded yet: " + manager.status)
    try:
        cfg = make_config(k, temperature, top_p, top_k, max_new_tokens, seed, min_confidence=min_confidence)
        race = start_race(pair, prompt, cfg, drafter)
        with admitted(limits, request, cfg):
            on_gpu(run)(race)
    except (ValueError, NonFiniteLogitsError) as err:
        raise gr.Error(str(err)) from None
    except Exception as err:  # out of memory, a broken checkpoint...
        raise gr.Error(f"The generation failed ({err.__class__.__name__}: {err}).") from None
    decode = lambda ids: pair.tokenizer.decode(ids, skip_special_tokens=True)
    spec, plain = race.spec.stats, race.plain.stats
    return {"text": decode(race.spec.token_ids), "token_ids": race.spec.token_ids,
            "plain_text": decode(race.plain.token_ids), "identical": race.identical, "pair": pair.name,
            "speedup": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None,
            "stats": spec.to_dict(), "plain_stats": plain.to_dict()}
