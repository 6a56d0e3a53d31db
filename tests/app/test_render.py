"""Rendering and plotting are pure functions: tested here without a browser."""
import dataclasses
import html
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest
import torch

from app import plots, teach
from app.handlers import lane_pieces
from app.race import advance, run, start_race
from app.render import Piece, legend_html, pane_html
from specdec_core import SpecConfig, generate
from specdec_core.text import Detokenizer, encode_prompt
from specdec_core.theory import PassCosts

from ..conftest import with_eos

TRICKY = ["<script>alert('x')</script>", "a & b < c > d \"q\" 'r'", "emoji 👋🏽 and 🇧🇷", "中文字符 テスト",
          "def f(x):\n    if x:\n\treturn '  spaced  '\n", "مرحبا بالعالم", "zero\u200bwidth\u0007bell"]


@pytest.mark.parametrize("text", TRICKY)
def test_streamed_pieces_rebuild_the_text_exactly(tiny, text):
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tiny.tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # split multi-byte characters are held back, never shown broken


@pytest.mark.parametrize("text", TRICKY)
def test_pane_html_escapes_everything(text):
    html_out = pane_html([Piece(text, "accepted", tip=text), Piece(text, "rejected", tip='"><img onerror=x>'),
                          Piece(text, "bonus")])
    assert "<script" not in html_out and "<img" not in html_out
    assert html.escape(text) in html_out


def test_legend_names_every_kind_without_relying_on_colour():
    legend = legend_html()
    for word in ("accepted", "rejected", "replacement", "bonus", "struck"):
        assert word in legend


def test_special_looking_prompt_text_is_literal(tiny):
    ids = encode_prompt(tiny.tokenizer, "stop <|im_end|> here")
    assert ids.count(tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1  # only the template's own


def test_pieces_follow_the_round(tiny):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=4, max_new_tokens=40)
    out, race = generate(pair, "abc", cfg), run(start_race(pair, "abc", cfg))
    pieces = lane_pieces(race, race.spec)
    kinds = {p.kind for p in pieces}
    assert {"accepted", "rejected", "replacement", "bonus"} <= kinds
    # a round with no room left to draft (one token to the cap) is a plain step, and says so
    assert out.events[-1].k == 0
    last = [p for p in pieces if "nothing to draft" in p.tip]
    assert [(p.kind, p.round) for p in last] == [("target", out.events[-1].round)]
    shown = "".join(p.text for p in pieces if p.kind in ("accepted", "replacement", "bonus", "target"))
    assert shown == out.text
    # one rejected token per round with a replacement
    assert sum(p.kind == "rejected" for p in pieces) == sum(e.token_kind == "replacement" for e in out.events)


def test_a_round_the_policy_left_undrafted_shows_as_a_plain_step_with_its_reason(tiny_set):
    """An unrelated draft whose forward costs 0.3 of a step: once this answer's verdicts say that drafting does not
    pay, rounds are plain steps, drawn as the target's own steps with the forecast that ruled drafting out; drafted
    rounds say the length the policy chose and the gain it expected; so do the step captions, the summary and the
    theory panel (the curve the last round's length was chosen from)."""
    costs = PassCosts({1: 1.0, 65: 10.6}, draft=0.3)
    pair = with_eos(dataclasses.replace(tiny_set["unrelated"], pass_costs=costs), [])
    race = run(start_race(pair, "hello", SpecConfig(k=4, max_new_tokens=60)))
    events = race.spec.events
    plain, drafted = [e for e in events if e.k and not e.drafted], [e for e in events if e.drafted]
    assert plain and drafted
    pieces = lane_pieces(race, race.spec, "pt")
    closing = {p.round: p for p in pieces if p.kind in ("target", "replacement", "bonus")}  # each round's last token
    for e in plain:  # what drafting was expected to bring, below a plain step's 1.00x
        assert closing[e.round].kind == "target" and 0 < e.gain <= e.curve[0]
        assert f"um passo comum: com a aceitação desta resposta até aqui, rascunhar não compensaria (esperado " \
               f"{e.gain:.2f}× a velocidade da decodificação comum" in closing[e.round].tip
        assert teach.caption(e).startswith(f"Round {e.round}: a plain step. At this answer's acceptance so far, drafting "
                                           f"would not pay (expected {e.gain:.2f}× plain decoding's speed)")
    for e in drafted:
        assert f"rodada {e.round}: a política rascunhou {len(e.drafted)}, esperando {e.gain:.2f}×" in closing[e.round].tip
        assert f"(the policy expected {e.gain:.2f}× from it)" in teach.caption(e)
    summary = plots.summary_html(race.plain.stats, race.spec.stats, None, False)
    assert f"{len(plain)} of {len(events)} rounds plain steps, where drafting would not pay" in summary
    policy = next(trace for trace in teach.theory(race).data if trace.name.startswith("the policy's forecast"))
    last = next(e for e in reversed(events) if e.curve)
    assert list(policy.y) == last.curve and f"before round {last.round}" in policy.name


def test_a_first_race_charges_neither_decoder_for_the_chat_heads():
    """The chat heads (each model's keys and values of the template's system block, copied into every prompt's cache)
    are read as the race starts, outside either decoder's clock: the first race's prompts read their own tokens
    alone, as every later race's do. Read at the first prompt, the target's head fell on whichever decoder read first,
    and the draft's on speculative decoding alone."""
    from specdec_core.models import make_pair
    from specdec_core.models.tiny import NOMINAL_COSTS, tiny_models

    target, draft, tok = tiny_models(seed=11)
    pair = dataclasses.replace(make_pair("fresh", target, draft, tok, torch.device("cpu"), torch.float32),
                               pass_costs=NOMINAL_COSTS)
    assert {role: h.cache for role, h in pair.heads.items()} == {"target": None, "draft": None}
    fed = []
    hooks = [model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
             for model in (target, draft)]
    try:
        race = start_race(pair, "a first race", SpecConfig(k=2, max_new_tokens=4))
        head = len(pair.heads["target"].ids)
        assert fed == [head, head] and all(h.cache is not None for h in pair.heads.values())
        fed.clear()
        run(race)
    finally:
        for hook in hooks:
            hook.remove()
    own = race.meta["prompt_tokens"] - 1 - head
    assert fed.count(own) == 3  # the plain decoder's prompt, the speculative decoder's target's and its draft's
    assert head not in fed


def test_race_interleaves_on_the_shared_clock_and_matches_the_engine(tiny):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=4, max_new_tokens=48)
    race = start_race(pair, "hello", cfg)
    moved = set()
    while True:
        # a lane's clock: its last round's, or before the first one its prompt's last chunk's
        clock = lambda lane: (lane.events[-1] if lane.events else lane.prefilling or SimpleNamespace(elapsed_s=0.0)).elapsed_s
        before = {race.plain.name: clock(race.plain), race.spec.name: clock(race.spec)}
        waiting = {lane.name for lane in (race.plain, race.spec) if not lane.done}
        lane = advance(race)
        if lane is None:
            break
        moved.add(lane.name)
        # the decoder that moved was the one behind on the shared clock
        assert before[lane.name] == min(before[name] for name in waiting)
    assert moved == {"plain", "speculative"}
    assert race.identical is True
    assert race.spec.token_ids == generate(pair, "hello", cfg).token_ids


def test_race_reports_sampling_as_not_comparable(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(temperature=1.0, max_new_tokens=10)))
    assert race.identical is None


def test_figures_build_from_stats(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=3, max_new_tokens=30)))
    figs = [plots.race_figure(race.plain.events, race.spec.events), plots.speed_figure(race.plain.stats, race.spec.stats),
            plots.rounds_figure(race.spec.events), plots.position_figure(race.spec.stats)]
    assert all(isinstance(f, go.Figure) for f in figs)
    race_fig = figs[0]
    assert race_fig.data[0].y[-1] == race.plain.events[-1].n_generated
    assert race_fig.data[1].x[-1] == pytest.approx(race.spec.events[-1].elapsed_s)
    assert list(figs[3].data[0].y) == race.spec.stats.acceptance_by_position
    summary = plots.summary_html(race.plain.stats, race.spec.stats, race.identical, False)
    assert "Speedup" in summary and "identical" in summary
    # empty inputs (before the first event) must not crash either
    plots.race_figure([], []), plots.speed_figure(None, None), plots.rounds_figure([]), plots.position_figure(None)


def test_a_race_that_waited_on_its_prompt_says_what_decoding_alone_gained():
    """A long prompt with a short answer: the speculative side reads the prompt with both models, and its end-to-end
    speedup falls below 1 however well it drafts. The summary then gives decoding's own speedup and the prompt's time."""
    from specdec_core.events import Stats

    def stats(method, seconds, prefill):
        return Stats(method, "model", tokens=10, seconds=seconds, prefill_s=prefill, tokens_per_s=10 / seconds,
                     decode_tokens_per_s=10 / (seconds - prefill))

    plain, spec = stats("autoregressive", 34.0, 32.0), stats("speculative", 50.0, 49.0)
    for lang, words in (("en", "decoding alone 2.00×, after reading the prompt (49.0 s with both models, 32.0 s plain)"),
                        ("pt", "só a decodificação 2.00×, depois de ler o prompt (49.0 s com os dois modelos, 32.0 s na comum)")):
        text = plots.summary_html(plain, spec, True, False, lang)
        assert "0.68×" in text and words in text
    short = stats("autoregressive", 34.0, 2.0), stats("speculative", 20.0, 3.0)  # the prompt was a small part
    assert "alone" not in plots.summary_html(*short, True, False)
    waiting = stats("speculative", 49.0, 48.0)  # as if nothing were decoded yet after the prompt: no speedup to give
    waiting.decode_tokens_per_s = 0.0
    assert "alone" not in plots.summary_html(plain, waiting, None, True)


def test_differing_greedy_outputs_say_where_they_part(tiny):
    """A target whose logits depend on the pass's shape can part the two outputs at a near-tie: the summary says
    where, with each decoder's token and the target's logit for it."""
    from specdec_core.models import first_divergence

    pair, cfg = with_eos(tiny, []), SpecConfig(k=4, max_new_tokens=12)
    race = run(start_race(pair, "part", cfg))
    assert race.identical and race.parted is None
    ids = encode_prompt(pair.tokenizer, "part")
    plain = race.plain.token_ids
    other = plain[:3] + [(plain[3] + 1) % pair.vocab] + plain[4:]
    d = first_divergence(pair, ids, plain, other)
    with torch.inference_mode():
        logits = pair.target(torch.tensor([ids + plain[:3]])).logits[0, -1]
    assert d["position"] == 3
    assert (d["ar_logit"], d["spec_logit"]) == pytest.approx((float(logits[plain[3]]), float(logits[other[3]])), rel=1e-5)
    assert first_divergence(pair, ids, plain, plain) is None
    at = 0
    for e in race.spec.events:  # the speculative lane takes the other token at position 3
        if at <= 3 < at + len(e.committed):
            e.committed[3 - at] = other[3]
        at += len(e.committed)
    assert race.identical is False
    n, a, la, b, lb = race.parted
    assert race.spec.token_ids[n] != race.plain.token_ids[n] and a == race.label(race.plain.token_ids[n])
    for lang, words in (("en", "outputs part at token"), ("pt", "as saídas se separam no token")):
        text = plots.summary_html(race.plain.stats, race.spec.stats, race.identical, False, lang, race.parted)
        assert words in text and f"{n + 1}" in text and html.escape(b) in text and f"{lb:.3f}" in text


def test_streamed_races_leave_their_progress_to_the_summary():
    """A race streams into nine outputs for tens of seconds. Gradio's tracker on each output redraws its timer every
    animation frame while it waits, and on a CPU the browser shares with the decoders, that drawing slows the very
    speeds the race shows. The summary says "Running…" instead; the trackers stay hidden."""
    from app.handlers import View
    from app.pairs import PairManager
    from app.ui import build_app

    streams = [d for d in build_app(PairManager("cpu", "float32")).config["dependencies"]
               if len(d["outputs"]) == len(View._fields) and d["api_name"] != "one_round"]
    assert {d["api_name"] for d in streams} == {"race", "race_1", "replay"}
    assert {d["show_progress"] for d in streams} == {"hidden"}
