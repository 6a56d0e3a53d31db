"""One drafted token's decision, from the numbers the engine recorded in its event (nothing recomputed)."""
from __future__ import annotations

import html

import plotly.graph_objects as go

from specdec_core.events import RoundEvent
from specdec_core.theory import expected_speedup, measured_costs, verify_cost_at

from .i18n import t
from .plots import AR_COLOR, DRAFT_COLOR, LAYOUT, SPEC_COLOR, _fig
from .render import rejected_at_end
from .tree import states


def row_of(e: RoundEvent, i: int) -> int:
    """The row of e.target_top that judged node i; i == len(drafted): the row the target's token came from."""
    if i < len(e.drafted):
        return e.parents[i] + 1
    return e.path[-1] + 1 if e.path else 0


def replaced(e: RoundEvent) -> int | None:
    """The node whose rejection the target's token replaced: the last choice judged where the path ends."""
    rejected = rejected_at_end(e)
    return rejected[-1] if e.token_kind == "replacement" and rejected else None


def where_text(e: RoundEvent, i: int, rounds: int, lang: str = "en") -> str:
    """Which round, and which node: its depth and, beside siblings, its rank among them, in words."""
    if i >= len(e.drafted):
        return t("where_token", lang, r=e.round, n=rounds)
    siblings = [j for j, parent in enumerate(e.parents) if parent == e.parents[i]]
    text = t("where", lang, r=e.round, n=rounds, i=i + 1, m=len(e.drafted), d=e.depth_of(i))
    return text + (t("where_choice", lang, j=siblings.index(i) + 1, s=len(siblings)) if len(siblings) > 1 else "")


def decision_text(e: RoundEvent, i: int, label, lang: str = "en") -> str:
    """What happened at node i (0-based) of round e, in words; i == len(drafted) is the target's token."""
    if i >= len(e.drafted):
        return t("bonus_token" if e.token_kind == "bonus" else "own_token", lang, x=repr(label(e.token)), p=e.p_token)
    x, kind = repr(label(e.drafted[i])), states(e)[i]
    if kind == "unreached":
        beaten = any(j in e.path for j in range(i) if e.parents[j] == e.parents[i])
        return t("tree_beaten" if beaten else "tree_cut", lang)
    last = i == replaced(e)  # the target's token was drawn after this rejection
    if e.greedy:
        top = e.target_top[row_of(e, i)]
        y = repr(label(top[0][0])) if top else "?"
        return t("greedy_same" if kind == "accepted" else "greedy_diff" if last else "tree_greedy_diff", lang, x=x, y=y)
    a = e.accept_probs[i]
    text = t("sampled", lang, x=x, q=e.q_drafted[i], p=e.p_drafted[i], a=a, u=e.uniforms[i])
    if kind == "accepted":
        return text + t("sampled_ok", lang, a=a)
    if not last:
        return text + t("tree_next", lang, a=a)
    top = ", ".join(f"{label(tok)!r} {v:.2f}" for tok, v in (e.residual_top or [])[:3])
    return text + t("sampled_no", lang, a=a, y=repr(label(e.token)), top=top)


def decision_figure(e: RoundEvent, i: int, label, lang: str = "en") -> go.Figure:
    """Top target (p) and draft (q) probabilities at the position, the drafted token outlined."""
    fig = _fig(t("f_decision", lang, r=e.round, i=i + 1) + (t("f_greedy", lang) if e.greedy else ""),
               barmode="group", yaxis_title=t("f_probability", lang), yaxis=dict(range=[0, 1.05]))
    row = row_of(e, i)
    if row >= len(e.target_top):
        return fig
    p_top = dict(e.target_top[row])
    q_top = dict(e.draft_top[i]) if i < len(e.draft_top) else {}
    ids = list(dict.fromkeys([*p_top, *q_top]))
    names = [html.escape(repr(label(tok))) for tok in ids]
    drafted = e.drafted[i] if i < len(e.drafted) else None
    outline = [3 if tok == drafted else 0 for tok in ids]
    fig.add_bar(x=names, y=[p_top.get(tok, 0) for tok in ids], name=t("f_p", lang), marker_color=SPEC_COLOR,
                marker_line=dict(width=outline, color="#000"))
    if q_top:
        fig.add_bar(x=names, y=[q_top.get(tok, 0) for tok in ids], name=t("f_q", lang), marker_color=DRAFT_COLOR,
                    marker_line=dict(width=outline, color="#000"))
    if e.residual_top and i in (replaced(e), len(e.drafted)):
        r = dict(e.residual_top)
        fig.add_bar(x=names, y=[r.get(tok, 0) for tok in ids], name=t("f_residual", lang), marker_color=AR_COLOR)
    return fig


def theory_figure(ar_stats, spec_stats, k: int, lang: str = "en", policy: RoundEvent | None = None) -> go.Figure:
    """Predicted speedup against K from this run's a, c and verify cost, with the measured point(s); and the curve the
    policy chose the last round's draft length from (`policy`: that round), with its choice on it."""
    fig = _fig(t("f_theory", lang), xaxis_title=t("f_k", lang), yaxis_title=t("f_speedup", lang))
    if policy is not None and policy.curve:
        n = max(range(len(policy.curve)), key=lambda j: (policy.curve[j], -j))
        fig.add_scatter(x=list(range(len(policy.curve))), y=policy.curve, name=t("f_policy", lang, r=policy.round,
                        a=spec_stats.acceptance_rate if spec_stats else 0.0), line=dict(color="#009e73"))
        fig.add_scatter(x=[n], y=[policy.curve[n]], mode="markers", name=t("f_policy_choice", lang, n=n),
                        marker=dict(size=12, color="#009e73", symbol="star"))
    if not ar_stats or not spec_stats or not spec_stats.drafted:
        return fig
    a, c, v = measured_costs(ar_stats, spec_stats)
    drafted = spec_stats.drafted / spec_stats.rounds  # below k where drafts were cut short
    ks = list(range(1, max(8, k) + 1))
    fig.add_scatter(x=ks, y=[expected_speedup(a, j, c) for j in ks], name=f"Leviathan et al. (a={a:.2f}, c={c:.2f})",
                    line=dict(color=AR_COLOR, dash="dot"))
    fig.add_scatter(x=ks, y=[expected_speedup(a, j, c, verify_cost_at(v, drafted, j)) for j in ks],
                    name=t("f_real_verify", lang, v=v, k=f"{drafted:.3g}"), line=dict(color=SPEC_COLOR))
    fig.add_scatter(x=[drafted], y=[spec_stats.decode_tokens_per_s / ar_stats.decode_tokens_per_s], mode="markers",
                    name=t("f_measured_decode", lang),
                    marker=dict(size=12, color=DRAFT_COLOR, symbol="diamond"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#999")
    fig.update_layout(**{**LAYOUT, "height": 340})
    return fig


def tree_theory_figure(events: list[RoundEvent], lang: str = "en") -> go.Figure:
    """Per tree round: the tokens the draft expected the target to accept (its path probabilities) and the
    tokens it accepted."""
    fig = _fig(t("f_tree_theory", lang), xaxis_title=t("f_round", lang), yaxis_title=t("f_accepted_tokens", lang))
    rounds = [e for e in events if e.drafted]
    if not rounds:
        return fig
    mean = lambda values: sum(values) / len(values)
    x = [e.round for e in rounds]
    fig.add_scatter(x=x, y=[e.expected for e in rounds], name=t("f_tree_expected", lang, m=mean([e.expected for e in rounds])),
                    line=dict(color=DRAFT_COLOR, dash="dot"))
    fig.add_scatter(x=x, y=[e.accepted for e in rounds], mode="markers", name=t("f_tree_measured", lang,
                    m=mean([e.accepted for e in rounds])), marker=dict(size=9, color=SPEC_COLOR, symbol="diamond"))
    fig.update_layout(**{**LAYOUT, "height": 340})
    return fig


SWEEP_COLORS = (SPEC_COLOR, DRAFT_COLOR, "#cc79a7", "#009e73")


def sweep_figure(series, lang: str = "en") -> go.Figure:
    """Measured speedup against K beside the prediction from each temperature's K = 1 run.

    series: (temperature, plain Stats, K = 1 speculative Stats, [(K, measured speedup), ...]) per temperature.
    """
    fig = _fig(t("f_sweep", lang), xaxis_title=t("f_k", lang), yaxis_title=t("f_speedup", lang))
    ks = list(range(1, 9))
    for (temperature, ar, spec1, points), color in zip(series, SWEEP_COLORS):
        a, c, v = measured_costs(ar, spec1)
        name = t("f_greedy_short", lang) if temperature == 0 else f"T = {temperature:g}"
        fig.add_scatter(x=ks, y=[expected_speedup(a, j, c, verify_cost_at(v, 1, j)) for j in ks],
                        name=t("f_predicted", lang, name=name, a=a), line=dict(color=color))
        fig.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers",
                        name=t("f_measured", lang, name=name),
                        marker=dict(size=11, color=color, symbol="diamond"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#999")
    fig.update_layout(**{**LAYOUT, "height": 360})
    return fig
