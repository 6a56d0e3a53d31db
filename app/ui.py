"""The Gradio interface, composed from small build_* functions."""
from __future__ import annotations

import inspect
import json
from functools import partial
from pathlib import Path

import gradio as gr

from specdec_core import SpecConfig
from specdec_core.config import MAX_GUESS, MAX_K, MAX_NEW_TOKENS, MAX_TEMPERATURE, MAX_TREE_NODES
from specdec_core.drafters import DRAFTERS

from . import handlers, teach
from .i18n import LANGUAGES, t
from .pairs import PRESETS
from .render import legend_html, message_html
from .trace import MAX_TRACE_BYTES

ASSETS = Path(__file__).resolve().parent / "assets"
PROMPTS = Path(__file__).resolve().parents[1] / "specdec_core" / "bench" / "prompts.jsonl"
CSS = (ASSETS / "style.css").read_text()

# A click on a token of the speculative pane, or a node of the draft tree, writes "round,position,nonce"
# into a hidden box; the box's change event opens the inspector there. The nonce makes a second click on
# the same token count.
CLICK_JS = """
() => {
  document.addEventListener("click", (event) => {
    const token = event.target.closest("#spec-pane .tok[data-pos], #tree-pane .tn[data-pos]");
    const box = document.querySelector("#pick textarea, #pick input");
    if (!token || !box) return;
    box.value = `${token.dataset.round},${token.dataset.pos},${Date.now()}`;
    box.dispatchEvent(new Event("input", {bubbles: true}));
  });
}
"""

# A race streams for tens of seconds: its summary says "Running…". Gradio's trackers, which redraw a timer on every
# output each animation frame, would take the browser's share of the CPU from the decoders beside it.
STREAMED = dict(api_visibility="private", concurrency_id="gpu", show_progress="hidden")
REPLAYS = 16  # replays at once


class key:
    """A text key (i18n.t) or a function of the language, where a component takes text."""

    def __init__(self, name):
        self.name = name

    def text(self, lang: str = "en") -> str:
        return self.name(lang) if callable(self.name) else t(self.name, lang)


class Texts:
    """Components whose text follows the language switch. `tx(gr.Slider, 1, 16, label=key("k"))` makes the
    component with each key's English text and remembers the keys, so each text is named once."""

    FIRST = {gr.Accordion: "label"}  # the attribute a component's first positional argument sets (else "value")

    def __init__(self):
        self.items = []

    def __call__(self, kind, *args, **kwargs):
        keys = {name: value for name, value in kwargs.items() if isinstance(value, key)}
        if args and isinstance(args[0], key):
            keys[self.FIRST.get(kind, "value")] = args[0]
            args = (args[0].text(), *args[1:])
        component = kind(*args, **{**kwargs, **{name: k.text() for name, k in keys.items() if name in kwargs}})
        self.items.append((component, keys))
        return component

    @property
    def components(self):
        return [component for component, _ in self.items]

    def updates(self, lang: str):
        return [gr.update(**{attr: k.text(lang) for attr, k in keys.items()}) for _, keys in self.items]


def example_prompts() -> list[str]:
    lines = PROMPTS.read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def status_html(manager, lang: str = "en") -> str:
    """The pair's state in `lang`, escaped (it can quote a model id a visitor typed)."""
    return message_html(manager.status_text(lang), "error" if manager.failed else "info")


def build_pair_bar(manager, tx: Texts):
    status = gr.HTML(status_html(manager), elem_id="pair-status")
    with tx(gr.Accordion, key("pair_box"), open=False, elem_id="pair-box"):
        with gr.Row(equal_height=True):
            preset = next((name for name, spec in PRESETS.items() if spec == manager.spec), None)
            choice = tx(gr.Dropdown, list(PRESETS), value=preset, label=key("pair"), scale=3)
            custom = tx(gr.Textbox, label=key("custom"), value=None if preset else manager.spec, elem_id="custom-pair",
                        placeholder="Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct", scale=3,
                        visible=manager.allow_custom)
            load = tx(gr.Button, key("load"), scale=1, elem_id="load-pair")
    return choice, custom, load, status


def wire_pair_bar(manager, choice, custom, load, status, lang):
    def switch(preset, custom_spec, language):
        spec = custom_spec.strip() if custom_spec and custom_spec.strip() else PRESETS.get(preset)
        if not spec:
            return message_html(t("pick_pair", language), "error")
        manager.load(spec)
        return status_html(manager, language)

    load.click(lambda language: message_html(t("loading_keeps", language)), lang, status,
               api_visibility="private").then(switch, [choice, custom, lang], status, api_visibility="private")
    gr.Timer(1.0).tick(partial(status_html, manager), lang, status, api_visibility="private",
                       show_progress="hidden", queue=False)


# the API's parameters: SpecConfig's fields with its defaults (but the chat template, always on here, and the
# inspector's top-n lists, which the API does not return), and the drafter
API_SIGNATURE = inspect.Signature(
    [inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)]
    + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
       for name, kind, default, _ in SpecConfig.options(skip=("chat", "record_top"))]
    + [inspect.Parameter("drafter", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=DRAFTERS[0], annotation=str),
       inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request)],
    return_annotation=dict)
DEFAULTS = SpecConfig()


def build_controls(tx: Texts):
    with gr.Row():
        prompt = tx(gr.Textbox, label=key("prompt"), lines=3, max_lines=12, elem_id="prompt", scale=3,
                    placeholder=key("prompt_hint"))
        with gr.Column(scale=2, min_width=320):
            k = tx(gr.Slider, 1, MAX_K, value=DEFAULTS.k, step=1, label=key("k"), elem_id="k")
            max_new = tx(gr.Slider, 1, MAX_NEW_TOKENS, value=DEFAULTS.max_new_tokens, step=1, label=key("max_new"),
                         elem_id="max-new")
            temperature = tx(gr.Slider, 0, MAX_TEMPERATURE, value=DEFAULTS.temperature, step=0.05, label=key("temperature"),
                             elem_id="temperature")
    gr.Examples(example_prompts(), inputs=prompt, label="Examples / Exemplos")
    with tx(gr.Accordion, key("more"), open=False):
        with gr.Row():
            top_p = tx(gr.Slider, 0.01, 1.0, value=DEFAULTS.top_p, step=0.01, label=key("top_p"))
            top_k = tx(gr.Slider, 0, 200, value=DEFAULTS.top_k, step=1, label=key("top_k"))
            seed = tx(gr.Number, DEFAULTS.seed, precision=0, minimum=0, label=key("seed"))
        with gr.Row():
            drafter = tx(gr.Radio, list(DRAFTERS), value=DRAFTERS[0], label=key("drafter"),
                         info=key("drafter_info"))
            adaptive = tx(gr.Checkbox, DEFAULTS.adaptive, label=key("adaptive"))
            confidence = tx(gr.Slider, 0, 0.95, value=DEFAULTS.min_confidence, step=0.05, label=key("confidence"),
                            info=key("confidence_info"))
            tree = tx(gr.Slider, 0, MAX_TREE_NODES, value=DEFAULTS.tree_nodes, step=1, label=key("tree_nodes"),
                      info=key("tree_info"), elem_id="tree-nodes")
            guess = tx(gr.Slider, 0, MAX_GUESS, value=DEFAULTS.guess, step=1, label=key("guess"), info=key("guess_info"))
        tx(gr.Markdown, key("rules"))
    with gr.Row():
        go = tx(gr.Button, key("generate"), variant="primary", elem_id="generate")
        stop = tx(gr.Button, key("stop"), variant="stop", elem_id="stop")
    # by the name settings.ask reads: SpecConfig's fields, and the drafter
    controls = dict(k=k, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new, seed=seed,
                    drafter=drafter, adaptive=adaptive, min_confidence=confidence, tree_nodes=tree, guess=guess)
    return prompt, controls, go, stop


def build_race(tx: Texts):
    tx(gr.HTML, key(legend_html))
    with gr.Row():
        with gr.Column():
            tx(gr.HTML, key(lambda lang: pane_title(t("plain_title", lang))))
            plain = gr.HTML(elem_id="plain-pane")
        with gr.Column():
            tx(gr.HTML, key(lambda lang: pane_title(t("spec_title", lang))))
            spec = gr.HTML(elem_id="spec-pane")
    tree = gr.HTML(elem_id="tree-pane")  # the latest (or the inspected) round's draft tree, when trees are drafted
    summary = gr.HTML(elem_id="summary")
    tx(gr.Markdown, key("fairness"))
    return plain, spec, tree, summary


def pane_title(text: str) -> str:
    return f'<div class="pane-title">{text}</div>'


def build_plots(tx: Texts):
    with gr.Row():
        race = tx(gr.Plot, label=key("race_plot"), elem_id="race-plot")
        speed = tx(gr.Plot, label=key("speed_plot"))
    with gr.Row():
        rounds = tx(gr.Plot, label=key("rounds_plot"))
        positions = tx(gr.Plot, label=key("positions_plot"))
    return race, speed, rounds, positions


def build_teaching(tx: Texts):
    pick = gr.Textbox(elem_id="pick", visible="hidden")  # written by CLICK_JS; outside the (lazy) accordion
    with tx(gr.Accordion, key("inspector"), open=False, elem_id="inspector") as inspector:
        with gr.Row():
            round_no = tx(gr.Slider, 1, MAX_NEW_TOKENS, value=1, step=1, label=key("round"))
            position = tx(gr.Slider, 1, max(MAX_K, MAX_TREE_NODES) + 1, value=1, step=1, label=key("position"))
        decision = gr.HTML(elem_id="decision")
        decision_plot = tx(gr.Plot, label=key("pq"))
    with tx(gr.Accordion, key("theory"), open=False, elem_id="theory"):
        tx(gr.Markdown, key("theory_note"))
        sweep_note = gr.HTML()
        theory_plot = tx(gr.Plot, label=key("theory_plot"), elem_id="theory-plot")
        with gr.Row():
            show_theory = tx(gr.Button, key("fill"))
            sweep = tx(gr.Button, key("sweep"), elem_id="sweep")
            temps = tx(gr.Checkbox, False, label=key("sweep_temps"))
    with tx(gr.Accordion, key("step_box"), open=False):
        with gr.Row():
            step = tx(gr.Button, key("step"), elem_id="step")
            export = tx(gr.Button, key("export"))
            trace_out = tx(gr.File, label=key("trace_out"), interactive=False)
        with gr.Row():
            trace_in = tx(gr.File, label=key("trace_in"), file_types=[".json"])
            speed = tx(gr.Slider, 0.25, 8, value=1, step=0.25, label=key("replay_speed"))
            replay = tx(gr.Button, key("replay"))
    with tx(gr.Accordion, key("how"), open=False, elem_id="how"):
        tx(gr.Markdown, key("explain"))
    return dict(inspector=inspector, round_no=round_no, position=position, pick=pick, decision=decision,
                decision_plot=decision_plot, sweep_note=sweep_note, theory_plot=theory_plot, show_theory=show_theory,
                sweep=sweep, temps=temps, step=step, export=export, trace_out=trace_out, trace_in=trace_in,
                speed=speed, replay=replay)


def wire_teaching(panel, manager, state, controls, prompt, outputs, runs):
    private = dict(api_visibility="private")
    lang = controls.by_name["lang"]
    inspect = dict(fn=teach.inspect, inputs=[state, panel["round_no"], panel["position"], lang],
                   outputs=[panel["decision"], panel["decision_plot"], panel["tree"]], **private)
    for control in (panel["round_no"], panel["position"]):
        control.change(**inspect)
    panel["pick"].change(teach.pick, [state, panel["pick"], lang],
                         [panel[name] for name in ("inspector", "round_no", "position", "decision", "decision_plot",
                                                   "tree")], **private)
    for run in runs:  # refresh the inspector and the theory panel when a run ends
        run.then(**inspect).then(teach.theory, [state, lang], panel["theory_plot"], **private)
    panel["show_theory"].click(teach.theory, [state, lang], panel["theory_plot"], **private)

    def sweep(data):
        yield from teach.sweep(manager, data[prompt], controls.read(data), data[panel["temps"]])

    def one_round(data):
        return teach.step_round(manager, data[state], data[prompt], controls.read(data))

    panel["sweep"].click(sweep, controls.inputs(prompt, panel["temps"]), [panel["sweep_note"], panel["theory_plot"]],
                         concurrency_id="gpu", **private)
    panel["step"].click(one_round, controls.inputs(state, prompt), outputs, concurrency_id="gpu", **private)
    panel["export"].click(teach.export, [state, lang], panel["trace_out"], **private)
    # a replay runs no model: visitors' replays run side by side, each for teach.MAX_REPLAY_S at most
    return panel["replay"].click(teach.replay, [panel["trace_in"], panel["speed"], lang], outputs, show_progress="hidden",
                                 concurrency_id="replay", concurrency_limit=REPLAYS, **private)


class Controls:
    """The controls a generation reads, by name; Gradio hands a handler whose inputs are a set one dict
    {component: value}, and `read` turns it into {name: value} for settings.ask."""

    def __init__(self, by_name: dict):
        self.by_name = by_name

    def inputs(self, *others) -> set:
        return {*self.by_name.values(), *others}

    def read(self, data: dict) -> dict:
        return {name: data[component] for name, component in self.by_name.items()}


def build_app(manager, limits=None) -> gr.Blocks:
    return build(manager, limits)[0]


def launch(demo: gr.Blocks, **options):
    """Serve the page: uploads (traces) capped at the trace limit, before Gradio stores them."""
    return demo.launch(css=CSS, js=CLICK_JS, footer_links=["api"], max_file_size=MAX_TRACE_BYTES, **options)


def build(manager, limits=None) -> tuple[gr.Blocks, Texts]:
    """The page, and the registry of its texts that the language switch updates."""
    with gr.Blocks(title="specdec: speculative decoding, live") as demo:
        tx = Texts()
        with gr.Row(equal_height=True):
            tx(gr.Markdown, key("intro"))
            lang = gr.Radio(list(LANGUAGES), value="English", label="Language / Idioma", elem_id="lang", scale=0,
                            min_width=220)
        choice, custom, load, status = build_pair_bar(manager, tx)
        prompt, named, go, stop = build_controls(tx)
        controls = Controls({**named, "lang": lang})
        plain, spec, tree, summary = build_race(tx)
        race_plot, speed_plot, rounds_plot, positions_plot = build_plots(tx)
        teaching = {**build_teaching(tx), "tree": tree}
        state = gr.State()
        lang.change(tx.updates, lang, tx.components, api_visibility="private", queue=False)

        shown = dict(plain=plain, spec=spec, tree=tree, summary=summary, race_plot=race_plot, speed_plot=speed_plot,
                     rounds_plot=rounds_plot, positions_plot=positions_plot, state=state)
        outputs = [shown[name] for name in handlers.View._fields]

        def race(data, request: gr.Request):  # Gradio fills `request` by its annotation
            yield from handlers.race_stream(manager, limits, data[prompt], controls.read(data), request)

        run = go.click(race, controls.inputs(prompt), outputs, **STREAMED)
        submit = prompt.submit(race, controls.inputs(prompt), outputs, **STREAMED)
        replay = wire_teaching(teaching, manager, state, controls, prompt, outputs, [run, submit])
        stop.click(None, cancels=[run, submit, replay])
        wire_pair_bar(manager, choice, custom, load, status, lang)

        def api(*args, **kwargs) -> dict:
            """Generate with plain and speculative decoding: progress each round, then the text and the statistics."""
            values = API_SIGNATURE.bind(*args, **kwargs)
            values.apply_defaults()
            values = dict(values.arguments)
            prompt, request = values.pop("prompt"), values.pop("request")
            yield from handlers.api_generate(manager, limits, prompt, {**values, "record_top": 0}, request)

        api.__signature__ = API_SIGNATURE
        api.__annotations__ = {name: p.annotation for name, p in API_SIGNATURE.parameters.items()} | {"return": dict}
        gr.api(api, api_name="generate", concurrency_id="gpu")
    return demo, tx
