"""Statistics -> Plotly figures, as pure functions of the two event streams."""
from __future__ import annotations

import html

import plotly.graph_objects as go

from specdec_core.events import RoundEvent, Stats

from .i18n import t

AR_COLOR, SPEC_COLOR, DRAFT_COLOR, VERIFY_COLOR = "#7a7a7a", "#0072b2", "#e69f00", "#56b4e9"  # Okabe-Ito
PROMPT_SHARE = 1 / 3  # the summary adds decoding's own speedup where a prompt took more of a run's time than this
LAYOUT = dict(template="plotly_white", height=300, margin=dict(l=50, r=20, t=50, b=40),
              font=dict(size=14), legend=dict(orientation="h", y=-0.25))


def _fig(title: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, font=dict(size=16)), **{**LAYOUT, **layout})
    return fig


def race_figure(ar: list[RoundEvent], spec: list[RoundEvent], lang: str = "en") -> go.Figure:
    """Tokens generated against each decoder's own elapsed compute time."""
    fig = _fig(t("f_race", lang), xaxis_title=t("f_own_seconds", lang), yaxis_title="tokens")
    for name, events, color in ((t("f_plain", lang), ar, AR_COLOR), (t("f_spec", lang), spec, SPEC_COLOR)):
        xs = [0.0] + [e.elapsed_s for e in events]
        ys = [0] + [e.n_generated for e in events]
        fig.add_scatter(x=xs, y=ys, name=name, mode="lines+markers", line=dict(color=color, shape="hv", width=3),
                        marker=dict(size=4))
    return fig


def speed_figure(ar: Stats | None, spec: Stats | None, lang: str = "en") -> go.Figure:
    """Tokens per second of each decoder, and where the speculative decoder's time goes."""
    fig = _fig(t("f_speed", lang), barmode="stack", yaxis_title="tokens / s")
    names = [t("f_plain_short", lang), t("f_spec", lang)]
    rates = [s.tokens_per_s if s else 0.0 for s in (ar, spec)]
    fig.add_bar(x=names, y=rates, marker_color=[AR_COLOR, SPEC_COLOR], name="tokens / s",
                text=[f"{r:.1f}" for r in rates], textposition="auto", xaxis="x", yaxis="y")
    parts = [(t("f_prefill", lang), "prefill_s", "#cccccc"), (t("f_drafting", lang), "draft_s", DRAFT_COLOR),
             (t("f_verifying", lang), "verify_s", VERIFY_COLOR), (t("f_other", lang), "overhead_s", "#999999")]
    for label, key, color in parts:
        fig.add_bar(x=[getattr(s, key) for s in (ar, spec) if s is not None],
                    y=[n for n, s in zip(names, (ar, spec)) if s is not None], orientation="h", name=label,
                    marker_color=color, xaxis="x2", yaxis="y2")
    fig.update_layout(xaxis=dict(domain=[0, 0.4]), xaxis2=dict(domain=[0.55, 1], title=t("f_seconds", lang)),
                      yaxis2=dict(anchor="x2"), height=320)
    return fig


def rounds_figure(spec: list[RoundEvent], lang: str = "en") -> go.Figure:
    """Accepted draft tokens in each round, with the draft length K asked for."""
    fig = _fig(t("f_rounds", lang), xaxis_title=t("f_round", lang), yaxis_title="tokens")
    rounds = [e.round for e in spec]
    fig.add_bar(x=rounds, y=[e.accepted for e in spec], name=t("f_accepted", lang), marker_color=SPEC_COLOR)
    fig.add_scatter(x=rounds, y=[len(e.drafted) for e in spec], name=t("f_drafted", lang), mode="lines",
                    line=dict(color=DRAFT_COLOR, dash="dot", shape="hv"))
    return fig


def position_figure(spec_stats: Stats | None, lang: str = "en") -> go.Figure:
    """P(accepted | reached) at each draft position: acceptance decays along the draft."""
    fig = _fig(t("f_positions", lang), xaxis_title=t("f_position", lang), yaxis_title=t("f_acceptance", lang),
               yaxis=dict(range=[0, 1.05]))
    rates = spec_stats.acceptance_by_position if spec_stats else []
    fig.add_bar(x=list(range(1, len(rates) + 1)), y=rates, marker_color=SPEC_COLOR, name=t("f_acceptance", lang),
                text=[f"{r:.0%}" for r in rates], textposition="auto")
    return fig


def summary_html(ar: Stats | None, spec: Stats | None, identical: bool | None, running: bool, lang: str = "en",
                 parted: tuple[int, str, float, str, float] | None = None) -> str:
    """One line of headline numbers. `parted`: where differing greedy outputs part (position, plain decoding's
    token and its logit, the speculative token and its logit); the token texts are escaped here."""
    running_text = t("running", lang)
    if spec is None or ar is None or not ar.tokens or not spec.tokens:
        return f'<div class="summary">{running_text}</div>' if running else ""
    speedup = spec.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0
    parts = [f"<b>{t('speedup', lang)} {speedup:.2f}×</b>",
             t("vs_tokens", lang, a=spec.tokens_per_s, b=ar.tokens_per_s),
             t("acceptance", lang, a=spec.acceptance_rate),
             *([t("plain_steps", lang, n=spec.plain_steps, r=spec.rounds)] if spec.plain_steps else []),
             t("per_round", lang, m=spec.mean_accepted_length, t=spec.tokens_per_round)]
    # a long prompt read by both models can outweigh what drafting gains: then decoding's own speedup too
    if max(s.prefill_s / s.seconds if s.seconds else 0.0 for s in (ar, spec)) > PROMPT_SHARE \
            and ar.decode_tokens_per_s and spec.decode_tokens_per_s:
        parts.append(t("after_prompt", lang, d=spec.decode_tokens_per_s / ar.decode_tokens_per_s, a=spec.prefill_s,
                       b=ar.prefill_s))
    if not running:
        if identical is False and parted:
            n, a, la, b, lb = parted
            parts.append(t("differ_at", lang, n=n + 1, a=f"<code>{html.escape(a)}</code>", la=la,
                           b=f"<code>{html.escape(b)}</code>", lb=lb))
        else:
            parts.append(t("sampling", lang) if identical is None else t("identical" if identical else "differ", lang))
    return f'<div class="summary">{running_text + " " if running else ""}{" · ".join(parts)}</div>'
