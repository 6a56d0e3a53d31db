"""A round's draft drawn as SVG: the accepted path highlighted, rejected nodes struck, unreached ones ghosted.

Each node's row is its first child's, so a chain is one straight row and every branch opens a row below.
Nodes carry data-round / data-pos like the speculative pane's tokens, so a click opens the inspector.
"""
from __future__ import annotations

import html

from specdec_core.events import RoundEvent

from .i18n import t
from .render import visible

W, H, GAP_X, GAP_Y, PAD, CHARS = 78, 24, 22, 10, 10, 9  # node box, gaps, margin (px); characters shown per node
# the text keys of each kind of node, spelled out so that a search for a key finds where it is used
TIPS = {"accepted": "tree_tip_accepted", "rejected": "tree_tip_rejected", "unreached": "tree_tip_unreached",
        "replacement": "tree_tip_replacement", "bonus": "tree_tip_bonus"}
LEGEND = {"accepted": "tree_key_accepted", "rejected": "tree_key_rejected", "unreached": "tree_key_unreached",
          "replacement": "tree_key_replacement", "bonus": "tree_key_bonus"}


def states(e: RoundEvent) -> list[str]:
    """Per node: "accepted" (on the path), "rejected" (judged and turned down) or "unreached" (an ancestor was
    rejected, or an earlier sibling was accepted first, so the target never judged it)."""
    path, out = set(e.path), []
    for i, parent in enumerate(e.parents):
        reached = parent < 0 or parent in path
        beaten = any(j in path for j in range(i) if e.parents[j] == parent)
        out.append("accepted" if i in path else "rejected" if reached and not beaten else "unreached")
    return out


def layout(parents: list[int]) -> tuple[list[int], list[int], int]:
    """(depth, row) per node and the number of rows; the root is depth 0, row 0 and not listed."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    depth, row = [0] * len(parents), [0] * len(parents)

    def place(node: int, d: int, r: int) -> int:  # returns the next free row
        kids = children.get(node, [])
        if node >= 0:
            depth[node], row[node] = d, r
        if not kids:
            return r + 1
        for kid in kids:
            r = place(kid, d + 1, r)
        return r

    rows = place(-1, 0, 0)
    return depth, row, rows


def tree_html(e: RoundEvent | None, label, lang: str = "en") -> str:
    if e is None or not e.drafted:
        return ""
    n, kinds = len(e.drafted), states(e)
    end = e.path[-1] if e.path else -1
    # the target's own token is drawn as the last child of the path's end: after the rejected ones, if any
    depth, row, rows = layout(e.parents + [end])
    kinds.append("replacement" if e.token_kind == "replacement" else "bonus")
    x = lambda d: PAD + d * (W + GAP_X)
    y = lambda r: PAD + r * (H + GAP_Y)
    width, height = x(max(depth) + 1), y(rows)
    edges, boxes = [], []
    for i in range(n + 1):
        parent = (e.parents[i] if i < n else end)
        px, py = (x(depth[parent]) + W if parent >= 0 else x(0) + H), y(row[parent] if parent >= 0 else 0) + H / 2
        cx, cy = x(depth[i]), y(row[i]) + H / 2
        on = kinds[i] in ("accepted", "replacement", "bonus")
        edges.append(f'<path class="te{" te-on" if on else ""}" d="M{px:.0f},{py:.0f} H{px + GAP_X / 2:.0f} '
                     f'V{cy:.0f} H{cx:.0f}"/>')
        token = e.drafted[i] if i < n else e.token
        text = visible(label(token))
        short = text if len(text) <= CHARS else text[: CHARS - 1] + "…"
        tip = t(TIPS[kinds[i]], lang, x=text, p=e.p_drafted[i] if i < n else e.p_token)
        boxes.append(f'<g class="tn tn-{kinds[i]}" data-round="{int(e.round)}" data-pos="{i + 1}" tabindex="0">'
                     f"<title>{html.escape(tip)}</title>"
                     f'<rect x="{cx:.0f}" y="{y(row[i]):.0f}" width="{W}" height="{H}" rx="5"/>'
                     f'<text x="{cx + W / 2:.0f}" y="{y(row[i]) + H / 2:.0f}">{html.escape(short)}</text></g>')
    root = (f'<circle class="tree-root" cx="{x(0) + H / 2:.0f}" cy="{y(0) + H / 2:.0f}" r="{H / 2 - 3:.0f}">'
            f"<title>{html.escape(t('tree_root', lang))}</title></circle>")
    caption = t("tree_caption", lang, r=e.round, n=n, d=e.depth, a=e.accepted, x=e.expected)
    svg = (f'<svg class="tree" width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
           f'role="img" aria-label="{html.escape(caption)}">{root}{"".join(edges)}{"".join(boxes)}</svg>')
    legend = "".join(f'<span class="tn-key tn-{kind}">{html.escape(t(name, lang))}</span>' for kind, name in LEGEND.items())
    return (f'<div class="tree-box"><div class="pane-title">{html.escape(t("tree_title", lang))}</div>'
            f'<div class="tree-caption">{html.escape(caption)}</div>'
            f'<div class="tree-legend">{legend}</div><div class="tree-scroll">{svg}</div></div>')
