"""Event handlers: generators that turn a race into UI outputs. No Gradio layout here."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import NamedTuple

import gradio as gr

from specdec_core.drafters import times_passes
from specdec_core.sampling import NonFiniteLogitsError

from . import plots
from .i18n import said, t
from .limits import visitor_of
from .race import Race, advance, start_race, stop
from .render import message_html, pane_html, pieces
from .settings import Ask, ask
from .tree import tree_html

UI_EVERY_S, PLOTS_EVERY_S = 0.12, 1.0  # streaming cadence: text often, figures less often (CPU they share)

try:  # on Hugging Face Spaces (ZeroGPU) a GPU is attached only inside decorated calls
    import spaces

    on_gpu = spaces.GPU(duration=int(os.environ.get("SPECDEC_GPU_SECONDS", "120")))
except ImportError:
    def on_gpu(fn):
        return fn


class View(NamedTuple):
    """Every output of a race, by name; the UI lists its components in this order."""
    plain: object
    spec: object
    tree: object
    summary: object
    race_plot: object
    speed_plot: object
    rounds_plot: object
    positions_plot: object
    state: object


def lane_pieces(race: Race, lane, lang: str = "en"):
    return pieces(lane.events, lane.texts, lane.tail, race.label, lang)


def view(race: Race, lang: str = "en", with_plots: bool = True, note: str = "", s_per_token: float | None = None) -> View:
    """Everything the screen shows of a race, derived from its events in `lang`. s_per_token: what a token of a
    prompt cost a model before (the estimate shown before a long prompt's first chunk)."""
    plain, spec = race.plain.stats, race.spec.stats  # summarised once per update: this runs beside the models
    summary = plots.summary_html(plain, spec, race.identical, not race.done, lang, race.parted)
    if not race.spec.events and not race.done:
        summary = prefill_html(race, lang, s_per_token) or summary
    panes = [pane_html(lane_pieces(race, lane, lang), t("waiting", lang)) for lane in (race.plain, race.spec)]
    tree = tree_html(next((e for e in reversed(race.spec.events) if e.drafted), None), race.label, lang)
    figs = ((plots.race_figure(race.plain.events, race.spec.events, lang), plots.speed_figure(plain, spec, lang),
             plots.rounds_figure(race.spec.events, lang), plots.position_figure(spec, lang))
            if with_plots else (gr.skip(),) * 4)
    return View(*panes, tree, summary + (message_html(note, "error") if note else ""), *figs, race)


PREFILL_SHOWN = 256  # prompts of at least this many tokens say what they will take before the first token


def prefill_parts(race: Race) -> tuple[int, int, float]:
    """(tokens of the prompt still to read, summed over the models that read it, tokens read, seconds spent on them).
    Each model reads all of it but its last token, which opens the first round."""
    n = max(race.meta.get("prompt_tokens", 0) - 1, 0)
    # plain decoding's target, speculative decoding's, and a draft model unless the drafter only looks up the prompt
    models = 2 + (race.meta.get("drafter") != "prompt-lookup")
    read, spent = 0, 0.0
    for lane in (race.plain, race.spec):
        if lane.prefilling is not None:
            earlier = n if lane.prefilling.model == "draft" else 0  # the draft reads after its lane's target
            read, spent = read + earlier + lane.prefilling.done, spent + lane.prefilling.elapsed_s
    return max(models * n - read, 0), read, spent


def prefill_html(race: Race, lang: str, s_per_token: float | None) -> str:
    """While a long prompt is read: how far, and about how long it still takes (measured on this prompt once it has
    begun, before that on the last one)."""
    n = race.meta.get("prompt_tokens", 0)
    if race.tokenizer is None or n < PREFILL_SHOWN:  # a replay has read no prompt
        return ""
    left, read, spent = prefill_parts(race)
    rate = spent / read if read >= 64 and spent > 0 else s_per_token
    eta = t("prefill_eta", lang, s=left * rate) if rate else ""
    return message_html(t("prefilling", lang, n=n, done=read, total=read + left) + eta, "info")


def empty_view(message: str, kind: str = "error") -> View:
    """Leave the panes as they are and say what is wrong."""
    return View(gr.skip(), gr.skip(), gr.skip(), message_html(message, kind), *(gr.skip(),) * 5)


@contextmanager
def admitted(limits, request, wanted: Ask, prompt_tokens: int):
    """Charged to the visitor (hosted): both decoders' new tokens, and the prompt each reads first."""
    if limits is None:
        yield
    else:
        limits.check_prompt(prompt_tokens)
        with limits.admit(visitor_of(request), 2 * (wanted.cfg.max_new_tokens + prompt_tokens)):
            yield


def race_stream(manager, limits, prompt, settings: dict, request: gr.Request = None):
    """Generator for the Generate button: yields the panes, summary and figures as the race runs.
    `settings`: the controls' values by name (settings.ask)."""
    pair = manager.pair  # this run keeps this pair even if another one is loaded meanwhile
    if pair is None:
        lang = settings.get("lang") or "en"
        yield empty_view(manager.status_text(lang) if manager.loading else t("no_model_pick", lang), "info")
        return
    try:
        wanted = ask(settings)
        if times_passes(pair, wanted.drafter):
            yield empty_view(t("timing_passes", wanted.lang), "info")
        race = start_race(pair, prompt, wanted.cfg, wanted.drafter)
        with admitted(limits, request, wanted, race.meta["prompt_tokens"]):
            yield from _drive(race, wanted.lang, getattr(manager, "prefill_s_per_token", None))
    except ValueError as err:
        yield empty_view(said(err, settings.get("lang") or "en"))
        return
    left, read, spent = prefill_parts(race)
    if not left and read:
        manager.prefill_s_per_token = spent / read


@on_gpu
def _drive(race: Race, lang: str, s_per_token: float | None = None):
    last_ui = last_plots = 0.0
    try:
        yield view(race, lang, False, s_per_token=s_per_token)  # before the prompt is read: what it will take
        while lane := advance(race):
            now = time.monotonic()
            # each chunk of a prompt is shown: the page moves, and a Stop there ends the prefill
            if not lane.events or now - last_ui >= UI_EVERY_S:
                plots_due = now - last_plots >= PLOTS_EVERY_S
                yield view(race, lang, plots_due, s_per_token=s_per_token)
                last_ui, last_plots = now, now if plots_due else last_plots
    except NonFiniteLogitsError:
        yield view(race, lang, True, t("stopped_nan", lang))
        return
    except Exception as err:  # out of memory, a broken checkpoint...: say so, keep serving
        yield view(race, lang, True, t("stopped_failed", lang, err=f"{err.__class__.__name__}: {err}"))
        return
    finally:  # ended, failed, stopped or left: its caches go now
        stop(race)
    yield view(race, lang, True)


def refused(err: Exception) -> gr.Error:
    """A visitor's request refused: one log line, no traceback (a real failure keeps Gradio's)."""
    print(f"refused: {err}", flush=True)
    return gr.Error(str(err), print_exception=False)


def api_generate(manager, limits, prompt, settings: dict, request=None):
    """Runs plain and speculative decoding. Yields a progress dict ({"done": False, ...}) each round, so that a
    cancelled or disconnected client stops the work within a round, and ends with both texts and their statistics."""
    pair = manager.pair
    if pair is None:
        raise refused(ValueError("No model is loaded yet: " + manager.status))
    if not isinstance(prompt, str):  # token ids would pass around the chat template and its control tokens
        raise refused(ValueError(f"prompt must be text (a string), got {type(prompt).__name__}"))
    try:
        wanted = ask(settings)
        race = start_race(pair, prompt, wanted.cfg, wanted.drafter)
        with admitted(limits, request, wanted, race.meta["prompt_tokens"]):
            yield from _rounds(race)
    except (ValueError, NonFiniteLogitsError) as err:
        raise refused(err) from None
    except Exception as err:  # out of memory, a broken checkpoint...
        raise gr.Error(f"The generation failed ({err.__class__.__name__}: {err}).") from None
    decode = lambda ids: pair.tokenizer.decode(ids, skip_special_tokens=True)
    spec, plain = race.spec.stats, race.plain.stats
    yield {"done": True, "text": decode(race.spec.token_ids), "token_ids": race.spec.token_ids,
           "plain_text": decode(race.plain.token_ids), "identical": race.identical, "pair": pair.name,
           "speedup": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None,
           "stats": spec.to_dict(), "plain_stats": plain.to_dict()}


@on_gpu
def _rounds(race: Race):
    try:
        while advance(race):
            yield {"done": False, "tokens": len(race.spec.token_ids), "plain_tokens": len(race.plain.token_ids)}
    finally:
        stop(race)
