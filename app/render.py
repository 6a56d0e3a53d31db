"""Events -> HTML, as pure functions. Every piece of model or user text passes through html.escape."""
from __future__ import annotations

import html
from dataclasses import dataclass

from specdec_core.events import RoundEvent

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
# the text keys of each kind, spelled out so that a search for a key finds where it is used
LEGEND = {"accepted": "kind_accepted", "rejected": "kind_rejected", "discarded": "kind_discarded",
          "replacement": "kind_replacement", "bonus": "kind_bonus"}
TIPS = {"replacement": "tip_replacement", "bonus": "tip_bonus", "target": "tip_target", "eos": "tip_eos",
        "length": "tip_length"}
ENDS = {"eos": "end_eos", "length": "end_length"}


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


def pieces(events: list[RoundEvent], texts: list[str], tail: str, label, lang: str = "en") -> list[Piece]:
    """A pane's pieces, derived from its events: `texts` is the text each committed token added to the
    output, `tail` the text held back to the end, `label(token)` a token's text on its own."""
    out, text = [], iter(texts)
    for e in events:
        out.extend(round_pieces(e, text, label, lang, tail if e.finished else ""))
    return out


def round_pieces(e: RoundEvent, text, label, lang: str, tail: str = "") -> list[Piece]:
    """The pieces one round adds to a pane, in the order the audience should read them: the accepted path, then
    (after a rejection) the choices rejected where it ends, each followed by what the draft had planned after it
    (its first children, discarded unchecked), then the target's token. The tree view shows the other branches."""
    out: list[Piece] = []
    for depth, i in enumerate(e.path[: len(e.committed)], start=1):
        tip = (t("tip_accepted_greedy", lang, r=e.round, i=depth) if e.greedy else
               t("tip_accepted", lang, r=e.round, i=depth, p=e.p_drafted[i], q=e.q_drafted[i], a=e.accept_probs[i]))
        out.append(Piece(next(text), "accepted", tip, e.round, i + 1))
    if len(e.committed) <= len(e.path):  # cut by an EOS on the path
        return out + ending(e, out, lang, tail)
    rejected = rejected_at_end(e)
    for i in rejected:
        tip = (t("tip_rejected_greedy", lang) if e.greedy else
               t("tip_rejected", lang, p=e.p_drafted[i], q=e.q_drafted[i], a=e.accept_probs[i], u=e.uniforms[i]))
        out.append(Piece(visible(label(e.drafted[i])), "rejected", tip, e.round, i + 1))
        node = i
        while (node := next((j for j, parent in enumerate(e.parents) if parent == node), None)) is not None:
            out.append(Piece(visible(label(e.drafted[node])), "discarded", t("tip_discarded", lang), e.round, node + 1))
    kind = e.token_kind if e.method == "speculative" and e.drafted else "target"
    # a replacement is explained by the last rejection, whose residual it was drawn from; a bonus at the end
    pos = 0 if kind == "target" else rejected[-1] + 1 if rejected else len(e.drafted) + 1
    out.append(Piece(next(text), kind, t(TIPS[kind], lang, p=e.p_token) + policy_tip(e, lang), e.round, pos))
    return out + ending(e, out, lang, tail)


def policy_tip(e: RoundEvent, lang: str) -> str:
    """What the draft model's policy chose for the round, and why (nothing for a drafter without one)."""
    if e.method != "speculative" or not e.curve:
        return ""
    if e.plain_step:  # drafting was expected to bring less than 1.00x
        return "\n" + t("tip_plain_step", lang, g=e.gain)
    if not e.drafted:  # no room left to draft
        return "\n" + t("tip_last_step", lang)
    return "\n" + t("tip_policy", lang, r=e.round, n=len(e.drafted), g=e.gain)


def rejected_at_end(e: RoundEvent) -> list[int]:
    """The choices judged where the accepted path ends, in the order judged: every one was rejected (there are
    none where the path reached a leaf and the target added a bonus token)."""
    end = e.path[-1] if e.path else -1
    return [i for i, parent in enumerate(e.parents) if parent == end]


def ending(e: RoundEvent, out: list[Piece], lang: str, tail: str) -> list[Piece]:
    """After a pane's last round: the text held back to the end, and why it ended."""
    end: list[Piece] = []
    if e.finished:
        if tail:
            end.append(Piece(tail, out[-1].kind if out else "target", "", e.round))
        if e.finish_reason in ("eos", "length"):
            end.append(Piece(t(ENDS[e.finish_reason], lang), "eos", t(TIPS[e.finish_reason], lang), e.round))
    return end


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
        where = f' data-round="{int(p.round)}" data-pos="{int(p.pos)}"' if p.pos else ""
        spans.append(f'<span class="tok {cls}"{where} title="{html.escape(p.tip)}">'
                     f"{marker}{html.escape(p.text)}</span>")
    return f'<div class="pane">{"".join(spans)}</div>'


def legend_html(lang: str = "en") -> str:
    items = "".join(f'<span class="tok {KINDS[kind][0]}">{KINDS[kind][1]}{t("sample", lang)}</span> {html.escape(t(name, lang))}'
                    for kind, name in LEGEND.items())
    return f'<div class="legend">{items}</div>'


def message_html(text: str, kind: str = "info") -> str:
    """A notice box; `text` is escaped."""
    return f'<div class="msg msg-{kind}">{html.escape(text)}</div>'
