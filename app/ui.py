"""The Gradio interface, composed from small build_* functions."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import gradio as gr

from specdec_core.config import MAX_K, MAX_NEW_TOKENS, MAX_TEMPERATURE

from . import handlers, teach
from .pairs import PRESETS
from .render import legend_html, message_html

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "style.css").read_text()

INTRO = """# Speculative decoding, live
A small **draft** model guesses the next K tokens; the large **target** model checks all K in **one** forward pass,
keeps the longest prefix it agrees with and adds one token of its own. The output is exactly the target's own
(token for token when greedy, the same distribution when sampling), with far fewer target passes."""

FAIRNESS = """**How the race is run.** Both decoders share one device, so they take turns: each step goes to the
decoder that is behind, and each is charged only its own compute time (synchronised on GPUs). The
timeline you see is that shared clock, as if each had the device to itself, so the race plays at
about half real speed. Numbers match `python -m specdec_core.bench` on the same prompt."""

RULES = (f"Rules: K 1–{MAX_K}; max new tokens 1–{MAX_NEW_TOKENS}; temperature 0–{MAX_TEMPERATURE:g} "
         "(below 0.0001 counts as 0 = greedy); top-p in (0, 1]; top-k 0 = off; seed a whole number ≥ 0. "
         "Prompt text is taken literally: control tokens such as <|im_end|> typed in it are plain text.")


def example_prompts() -> list[str]:
    lines = (ASSETS / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def status_html(manager) -> str:
    """The pair's state, escaped (it can quote a model id a visitor typed)."""
    text = manager.status
    return message_html(text, "error" if text.startswith("Could not") else "info")


def build_pair_bar(manager):
    status = gr.HTML(status_html(manager), elem_id="pair-status")
    with gr.Accordion("Model pair", open=False, elem_id="pair-box"):
        with gr.Row(equal_height=True):
            preset = next((name for name, spec in PRESETS.items() if spec == manager.spec), None)
            choice = gr.Dropdown(list(PRESETS), value=preset, label="Model pair (target ← draft)", scale=3)
            custom = gr.Textbox(label="…or custom TARGET_ID,DRAFT_ID", value=None if preset else manager.spec,
                                elem_id="custom-pair",
                                placeholder="Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct",
                                scale=3, visible=manager.allow_custom)
            load = gr.Button("Load pair", scale=1, elem_id="load-pair")
    return choice, custom, load, status


def build_controls():
    with gr.Row():
        prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, elem_id="prompt", scale=3,
                            placeholder="Ask for some code, a summary, a translation…")
        with gr.Column(scale=2, min_width=320):
            k = gr.Slider(1, MAX_K, value=4, step=1, label="K: draft tokens per round", elem_id="k")
            max_new = gr.Slider(1, MAX_NEW_TOKENS, value=96, step=1, label="Max new tokens", elem_id="max-new")
            temperature = gr.Slider(0, MAX_TEMPERATURE, value=0.0, step=0.05, label="Temperature (0 = greedy)")
    gr.Examples(example_prompts(), inputs=prompt, label="Examples: code, editing, extraction, summary, chat, math, translation")
    with gr.Accordion("More settings", open=False):
        with gr.Row():
            top_p = gr.Slider(0.01, 1.0, value=1.0, step=0.01, label="Top-p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
            seed = gr.Number(0, precision=0, minimum=0, label="Seed")
        with gr.Row():
            drafter = gr.Radio(["model", "prompt-lookup", "early-exit"], value="model", label="Drafter",
                               info="draft model · n-gram lookup in the prompt (no model) · target's first layers")
            adaptive = gr.Checkbox(False, label="Adaptive K (grow after full acceptance, shrink after a rejection)")
            confidence = gr.Slider(0, 0.95, value=0.0, step=0.05, label="Stop a draft below this draft confidence",
                                   info="0 = always draft K tokens")
        gr.Markdown(RULES)
    with gr.Row():
        go = gr.Button("Generate", variant="primary", elem_id="generate")
        stop = gr.Button("Stop", variant="stop", elem_id="stop")
    return prompt, [k, temperature, top_p, top_k, max_new, seed, drafter, adaptive, confidence], go, stop


def build_race():
    gr.HTML(legend_html())
    with gr.Row():
        with gr.Column():
            gr.HTML('<div class="pane-title">Plain decoding (target only)</div>')
            plain = gr.HTML(elem_id="plain-pane")
        with gr.Column():
            gr.HTML('<div class="pane-title">Speculative decoding (draft + target)</div>')
            spec = gr.HTML(elem_id="spec-pane")
    summary = gr.HTML(elem_id="summary")
    gr.Markdown(FAIRNESS)
    return plain, spec, summary


def build_plots():
    with gr.Row():
        race = gr.Plot(label="Race", elem_id="race-plot")
        speed = gr.Plot(label="Speed")
    with gr.Row():
        rounds = gr.Plot(label="Rounds")
        positions = gr.Plot(label="Acceptance by position")
    return race, speed, rounds, positions


EXPLAIN_EN = """**Why the output does not change.** Each drafted token x is kept with probability min(1, p(x)/q(x)),
where p is the target's probability and q the draft's. When it is rejected, the target's token is drawn from
max(0, p − q), renormalised: exactly the probability mass the draft under-covered. The two cases add up to p,
so every token has the target's own distribution (greedy: keep a draft token only if it is the target's argmax).

**Why it is faster.** One target pass scores all K drafts at once, and on memory-bound hardware a pass over
K+1 tokens costs little more than over one. With acceptance rate a, a round yields (1 − a^(K+1)) / (1 − a)
tokens for the price of K draft steps and one target pass."""

EXPLAIN_PT = """**Por que a saída não muda.** Cada token rascunhado x é mantido com probabilidade min(1, p(x)/q(x)), onde p é
a probabilidade do modelo alvo e q a do rascunho. Quando é rejeitado, o token do alvo é sorteado de
max(0, p − q), renormalizada: exatamente a massa que o rascunho cobriu de menos. Os dois casos somam p, então
cada token tem a distribuição do próprio alvo (no modo guloso: mantém o rascunho só se for o argmax do alvo).

**Por que é mais rápido.** Uma passada do alvo avalia os K rascunhos de uma vez e, em hardware limitado por
memória, uma passada sobre K+1 tokens custa pouco mais que sobre um. Com taxa de aceitação a, cada rodada rende
(1 − a^(K+1)) / (1 − a) tokens pelo preço de K passos do rascunho e uma passada do alvo."""


def build_teaching():
    with gr.Accordion("Inspect a drafted token", open=False, elem_id="inspector"):
        with gr.Row():
            round_no = gr.Slider(1, MAX_NEW_TOKENS, value=1, step=1, label="Round")
            position = gr.Slider(1, MAX_K + 1, value=1, step=1, label="Position in the round (K+1 = target's token)")
        decision = gr.HTML(elem_id="decision")
        decision_plot = gr.Plot(label="p vs q")
    with gr.Accordion("Theory next to measurement", open=False, elem_id="theory"):
        gr.Markdown("Predicted speedup for K = 1..8 from this run's measured acceptance rate a, draft cost c "
                    "(one draft step / one target step) and verify cost; the dotted curve is the paper's model, "
                    "which assumes a K+1-token pass costs one step.")
        sweep_note = gr.HTML()
        theory_plot = gr.Plot(label="Theory", elem_id="theory-plot")
        with gr.Row():
            show_theory = gr.Button("Fill from the last run")
            sweep = gr.Button("Sweep K = 1..8 on this prompt (up to 64 tokens each)")
    with gr.Accordion("Step through, export and replay", open=False):
        with gr.Row():
            step = gr.Button("Step one round", elem_id="step")
            export = gr.Button("Export the last run as a trace")
            trace_out = gr.File(label="Trace (JSON)", interactive=False)
        with gr.Row():
            trace_in = gr.File(label="Replay a trace (no model needed)", file_types=[".json"])
            speed = gr.Slider(0.25, 8, value=1, step=0.25, label="Replay speed")
            replay = gr.Button("Replay")
    with gr.Accordion("How it works / Como funciona", open=False):
        with gr.Tabs():
            with gr.Tab("English"):
                gr.Markdown(EXPLAIN_EN)
            with gr.Tab("Português (Brasil)"):
                gr.Markdown(EXPLAIN_PT)
    return dict(round_no=round_no, position=position, decision=decision, decision_plot=decision_plot,
                sweep_note=sweep_note, theory_plot=theory_plot, show_theory=show_theory, sweep=sweep, step=step,
                export=export, trace_out=trace_out, trace_in=trace_in, speed=speed, replay=replay)


def wire_teaching(t, manager, state, prompt, settings, outputs, runs):
    private = dict(api_visibility="private")
    inspect = dict(fn=teach.inspect, inputs=[state, t["round_no"], t["position"]],
                   outputs=[t["decision"], t["decision_plot"]], **private)
    for control in (t["round_no"], t["position"]):
        control.change(**inspect)
    for run in runs:  # refresh the inspector and the theory panel when a run ends
        run.then(**inspect).then(teach.theory, state, t["theory_plot"], **private)
    t["show_theory"].click(teach.theory, state, t["theory_plot"], **private)
    t["sweep"].click(partial(teach.sweep, manager), [prompt, *settings], [t["sweep_note"], t["theory_plot"]],
                     concurrency_id="gpu", **private)
    t["step"].click(partial(teach.step_round, manager), [state, prompt, *settings], outputs, concurrency_id="gpu",
                    **private)
    t["export"].click(teach.export, state, t["trace_out"], **private)
    t["replay"].click(teach.replay, [t["trace_in"], t["speed"]], outputs, **private)


def build_app(manager, limits=None) -> gr.Blocks:
    with gr.Blocks(title="specdec: speculative decoding, live") as demo:
        gr.Markdown(INTRO)
        choice, custom, load, status = build_pair_bar(manager)
        prompt, settings, go, stop = build_controls()
        plain, spec, summary = build_race()
        figures = build_plots()
        teaching = build_teaching()
        state = gr.State()

        outputs = [plain, spec, summary, *figures, state]
        def race(prompt, k, temperature, top_p, top_k, max_new_tokens, seed, drafter, adaptive, min_confidence,
                 request: gr.Request):  # Gradio fills `request` by its annotation (a partial would hide it)
            yield from handlers.race_stream(manager, limits, prompt, k, temperature, top_p, top_k, max_new_tokens,
                                            seed, drafter, adaptive, min_confidence, request)

        run = go.click(race, [prompt, *settings], outputs, api_visibility="private", concurrency_id="gpu")
        submit = prompt.submit(race, [prompt, *settings], outputs, api_visibility="private", concurrency_id="gpu")
        stop.click(None, cancels=[run, submit])
        wire_teaching(teaching, manager, state, prompt, settings, outputs, [run, submit])

        def switch(preset, custom_spec):
            spec = custom_spec.strip() if custom_spec and custom_spec.strip() else PRESETS.get(preset)
            if not spec:
                return message_html("Pick a pair from the list or type TARGET_ID,DRAFT_ID.", "error")
            manager.load(spec)
            return status_html(manager)

        load.click(lambda: message_html("Loading… the current pair keeps serving until the new one is ready."),
                   None, status, api_visibility="private").then(switch, [choice, custom], status,
                                                               api_visibility="private")
        gr.Timer(1.0).tick(partial(status_html, manager), None, status, api_visibility="private",
                           show_progress="hidden", queue=False)

        def api(prompt: str, k: int = 4, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                max_new_tokens: int = 128, seed: int = 0, drafter: str = "model", request: gr.Request = None) -> dict:
            """Generate with plain and speculative decoding; returns the text and the statistics."""
            return handlers.api_generate(manager, limits, prompt, k, temperature, top_p, top_k, max_new_tokens, seed,
                                         drafter, request)

        gr.api(api, api_name="generate", concurrency_id="gpu")
    return demo
