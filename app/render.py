"""Events -> HTML, as pure functions. Every piece of model or user text passes through html.escape."""
from __future__ import annotations

import html
from dataclasses import dataclass

from specdec_core.events import RoundEvent
from specdec_core.text import Detokenizer, token_text

from .i18n import t

# kind -> (css class, marker shown before the token for colour-blind viewers); legend words in i18n.py
KINDS = {
    "accepted": ("tok-acc", ""),
    "rejected": ("tok-rej", ""),
    "discarded": ("tok-dis", ""),
    "replacement": ("tok-rep", "▸"),
    "bonus": ("tok-bon", "+"),
    "target": ("tok-ar", ""),
}


@dataclass
class Piece:
    text: str
    kind: str
    tip: str = ""
    round: int = 0
    pos: int = 0  # 1-based position in its round for the inspector (0: nothing to inspect)


def visible(text: str) -> str:
    """Make whitespace of a token that never joins the output visible (it is shown struck through)."""
    return text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·") or "∅"


def pieces_for(event: RoundEvent, detok: Detokenizer, tokenizer) -> list[Piece]:
    """The pieces one round adds to a pane, in the order the audience should read them."""
    out: list[Piece] = []
    fmt = lambda x: f"{x:.3f}"
    for i, tok in enumerate(event.committed[: event.accepted]):
        tip = (f"accepted · round {event.round}, position {i + 1}\np(target) = {fmt(event.p_drafted[i])}, "
               f"q(draft) = {fmt(event.q_drafted[i])}\naccept with min(1, p/q) = {fmt(event.accept_probs[i])}")
        if event.greedy:
            tip = f"accepted · round {event.round}, position {i + 1}\ndraft token = target's argmax"
        out.append(Piece(detok.add(tok), "accepted", tip, event.round, i + 1))
    n = event.accepted
    if n < len(event.drafted) and len(event.committed) > n:  # a rejection happened (and was not cut by EOS)
        tip = (f"rejected · p = {fmt(event.p_drafted[n])}, q = {fmt(event.q_drafted[n])}, "
               f"min(1, p/q) = {fmt(event.accept_probs[n])}, drawn u = {fmt(event.uniforms[n])}")
        if event.greedy:
            tip = "rejected · the target's argmax is a different token"
        out.append(Piece(visible(token_text(tokenizer, event.drafted[n])), "rejected", tip, event.round, n + 1))
        for j, t in enumerate(event.drafted[n + 1:], start=n + 2):
            out.append(Piece(visible(token_text(tokenizer, t)), "discarded",
                             "drafted after a rejection: discarded unchecked", event.round, j))
    if len(event.committed) > n:
        kind = event.token_kind if event.method == "speculative" else "target"
        tip = {"replacement": "the target's own token, sampled from the residual max(0, p - q)",
               "bonus": "all drafts accepted: the verification pass gives this token for free",
               "target": "one target step"}[kind] + f"\np = {fmt(event.p_token)}"
        # a replacement is explained by the rejection it follows
        pos = {"replacement": n + 1, "bonus": len(event.drafted) + 1}.get(kind, 0)
        out.append(Piece(detok.add(event.committed[n]), kind, tip, event.round, pos))
    if event.finished:
        tail = detok.flush()
        if tail:
            out.append(Piece(tail, out[-1].kind if out else "target", "", event.round))
        if event.finish_reason == "eos":
            out.append(Piece("end", "eos", "the model ended its answer (EOS)", event.round))
        elif event.finish_reason == "length":
            out.append(Piece("max tokens", "eos", "max new tokens reached", event.round))
    return out


def pane_html(pieces: list[Piece], placeholder: str = "") -> str:
    if not pieces:
        return f'<div class="pane empty">{html.escape(placeholder)}</div>'
    spans = []
    for p in pieces:
        if p.kind == "eos":
            spans.append(f'<span class="tok-eos" title="{html.escape(p.tip)}">{html.escape(p.text)}</span>')
            continue
        cls, mark = KINDS[p.kind]
        marker = f'<span class="mark" aria-hidden="true">{mark}</span>' if mark else ""
        where = f' data-round="{p.round}" data-pos="{p.pos}"' if p.pos else ""
        spans.append(f'<span class="tok {cls}"{where} title="{html.escape(p.tip)}">'
                     f"{marker}{html.escape(p.text)}</span>")
    return f'<div class="pane">{"".join(spans)}</div>'


def legend_html(lang: str = "en") -> str:
    items = "".join(f'<span class="tok {cls}">{mark}{t("sample", lang)}</span> {html.escape(t("kind_" + kind, lang))}'
                    for kind, (cls, mark) in KINDS.items() if kind != "target")
    return f'<div class="legend">{items}</div>'


def message_html(text: str, kind: str = "info") -> str:
    """A notice box; `text` is escaped."""
    return f'<div class="msg msg-{kind}">{html.escape(text)}</div>'
