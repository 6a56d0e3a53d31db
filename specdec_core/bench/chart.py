"""The bench's chart: median speedup over plain decoding per prompt category."""
from __future__ import annotations

import statistics
import threading
from pathlib import Path

PNG_TIMEOUT_S = 120.0


def drafts(settings: dict) -> str:
    stop = settings.get("min_confidence")
    return f"K≤{settings['k']} (cut below {stop:g})" if stop else f"K={settings['k']}"


def chart(report: dict, path: Path) -> None:
    """Median speedup over plain decoding per prompt category, for specdec and for transformers."""
    import plotly.graph_objects as go

    groups: dict[str, list[dict]] = {}
    for e in report["prompts"]:
        groups.setdefault(e["category"] or e["id"], []).append(e)
    cats = list(groups)
    series = [(f"specdec ({report['settings']['drafter']} drafter)", "#0072b2", lambda e: e["speedup"])]
    if all("hf_assisted" in e for e in report["prompts"]):
        series.append(("transformers assisted generation", "#e69f00",
                       lambda e: e["hf_assisted"]["tokens_per_s"] / e["ar"]["tokens_per_s"]))
    fig = go.Figure()
    for name, color, value in series:
        ys = [statistics.median(value(e) for e in groups[c]) for c in cats]
        fig.add_bar(name=name, x=cats, y=ys, marker_color=color, text=[f"{y:.2f}×" for y in ys], textposition="outside")
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="plain decoding")
    weights = report["target_weights"].split(",")[0]
    fig.update_layout(title=f"Speedup over plain decoding: {report['pair']} pair, {report['device']}, target {weights}, "
                            f"{drafts(report['settings'])}, {report['settings']['max_new_tokens']} new tokens",
                      yaxis_title="speedup (×), median per category", barmode="group", template="plotly_white",
                      width=1000, height=500, legend=dict(orientation="h", y=-0.15))
    fig.write_html(path.with_suffix(".html"), include_plotlyjs="cdn")
    failed: list[Exception] = []

    def export():
        try:
            fig.write_image(path)
        except Exception as err:  # kaleido needs a Chrome/Chromium; the HTML chart is always written
            failed.append(err)

    # kaleido drives a browser, which has been seen to hang for good: the bench gives it up and goes on
    worker = threading.Thread(target=export, daemon=True, name="png chart")
    worker.start()
    worker.join(PNG_TIMEOUT_S)
    if worker.is_alive() or failed:
        why = f"timed out after {PNG_TIMEOUT_S:g} s" if worker.is_alive() else f"{failed[0].__class__.__name__}: {failed[0]}"
        print(f"PNG chart skipped ({why}); wrote {path.with_suffix('.html')}")
