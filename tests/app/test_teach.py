"""Teaching tools without a browser: the sweep, clicking a token, and both languages."""
import ast
import re
from pathlib import Path
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from app import teach
from app.handlers import lane_pieces, view
from app.i18n import CORE_PT, TEXT, said, t
from app.inspector import decision_text
from app.pairs import PairManager, Weights
from app.race import run, start_race
from app.ui import build
from specdec_core import SpecConfig
from specdec_core.messages import MESSAGES, NOTES, Note


def test_sweep_runs_every_k_at_every_temperature_and_plots_both(tiny):
    manager = SimpleNamespace(pair=tiny)
    settings = dict(k=4, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0, drafter="model",
                    adaptive=False, min_confidence=0.0, lang="en")
    steps = list(teach.sweep(manager, "hello", settings, True))
    notes = [s[0] for s in steps[:-1]]
    assert len(notes) == 3 * 8 and "24 of 24" in notes[-1]
    note, fig = steps[-1]
    assert "Sweep done" in note and isinstance(fig, go.Figure)
    measured = [tr for tr in fig.data if tr.name.endswith("measured")]
    predicted = [tr for tr in fig.data if tr.name.endswith(")") and "predicted" in tr.name]
    assert [tr.name.split(":")[0] for tr in measured] == ["greedy", "T = 0.7", "T = 1"]
    assert all(list(tr.x) == list(range(1, 9)) and all(y > 0 for y in tr.y) for tr in measured)
    assert len(predicted) == 3


def test_sweep_without_a_model_says_so():
    out = list(teach.sweep(SimpleNamespace(pair=None), "hi", dict(k=4, max_new_tokens=10, lang="pt"), False))
    assert "Nenhum modelo" in out[0][0]


def test_clicked_token_positions_match_the_inspector(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=4, max_new_tokens=40)))
    checked = set()
    for piece in lane_pieces(race, race.spec):
        if not piece.pos:
            continue
        opened, round_no, position, text, _, _ = teach.pick(race, f"{piece.round},{piece.pos},123", "en")
        assert (round_no, position) == (piece.round, piece.pos) and opened.open is True
        expected = {"accepted": "equal: accepted", "rejected": "different: rejected", "replacement": "different",
                    "discarded": "discarded unchecked", "bonus": "bonus token"}[piece.kind]
        assert expected in text, (piece, text)
        checked.add(piece.kind)
    assert {"accepted", "rejected", "replacement", "bonus"} <= checked
    assert all(p.pos == 0 for p in lane_pieces(race, race.plain))  # plain decoding has no drafts to inspect
    assert teach.pick(race, "not a position", "en")[0] is not None  # garbage from the page is ignored


def test_portuguese_covers_every_text_and_keeps_numbers():
    for key, (en, pt) in TEXT.items():
        assert en and pt, key
        assert sorted(re.findall(r"{(\w+)", en)) == sorted(re.findall(r"{(\w+)", pt)), key  # same fields
    assert t("generate", "Português (Brasil)") == t("generate", "pt") == "Gerar"
    assert t("generate", "klingon") == "Generate"


def literal_messages(path: Path) -> list[str]:
    """Where `path` raises ValueError or RuntimeError with a message written out in English, not a text key."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", "") in (
                "ValueError", "RuntimeError") and node.exc.args and isinstance(node.exc.args[0], (ast.Constant, ast.JoinedStr)):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_every_refusal_a_visitor_can_read_is_said_in_both_languages():
    assert set(CORE_PT) == set(MESSAGES) | set(NOTES)  # every refusal and note of the core has its Portuguese here
    root = Path(__file__).resolve().parents[2]
    reachable = [*(root / "app").glob("*.py"), *(root / "specdec_core" / name for name in (
        "config.py", "engine.py", "text.py", "drafters.py", "drafts.py", "lookup.py", "models/bundled.py"))]  # the app, and what visitors reach
    assert [where for path in reachable for where in literal_messages(path)] == []
    assert len(literal_messages(root / "specdec_core" / "models" / "load.py")) > 1  # the scan finds them (loader options)
    with pytest.raises(ValueError) as refused:
        SpecConfig(k=99)
    assert "entre 1 e 16" in said(refused.value, "pt") and "between 1 and 16" in str(refused.value)
    assert Weights("int8", True).text("pt") == "int8, exato: os mesmos logits num passo e numa passada, pré-empacotado"


def test_a_loads_progress_and_its_refusals_are_said_in_the_pages_language():
    manager = PairManager("cpu", "float32", target_quant="blocks")
    manager.load("tiny")  # its layers take 64 inputs: no blocks of 256, refused by key
    assert "múltiplo de 256 entradas" in manager.status_text("pt") and "multiple of 256 inputs" in manager.status
    manager._progress(0.3, Note("load_reading", model="Qwen"))
    assert manager.status_text("pt") == "Carregando: lendo Qwen (30%)"
    assert manager.status == "Loading: reading Qwen (30%)"


def test_results_follow_the_language(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=4, max_new_tokens=30)))
    shown = view(race, "pt")
    assert "Aceleração" in shown.summary and "idêntica" in shown.summary
    assert [fig.layout.title.text for fig in (shown.race_plot, shown.speed_plot, shown.rounds_plot,
                                              shown.positions_plot)] == [
        t(key, "pt") for key in ("f_race", "f_speed", "f_rounds", "f_positions")]
    tips = {p.kind: p.tip for p in lane_pieces(race, race.spec, "pt")}
    assert tips["accepted"].startswith("aceito · rodada") and tips["rejected"].startswith("rejeitado")
    assert "máx. de tokens" in shown.spec
    assert view(race, "en").spec != shown.spec  # the same race, drawn again in English
    e = next(e for e in race.spec.events if e.token_kind == "replacement")
    assert teach.caption(e, "pt").startswith(f"Rodada {e.round}: rascunhou {len(e.drafted)}")
    assert "rejeitado" in decision_text(e, e.accepted, race.label, "pt")
    assert "replaced the" in teach.caption(e, "en")


def test_the_language_switch_updates_every_registered_component(tiny):
    manager = SimpleNamespace(pair=tiny, status_text=lambda lang: "Ready", spec="tiny", allow_custom=True, loading=False,
                              failed=False)
    _, tx = build(manager)
    en, pt = tx.updates("English"), tx.updates("Português (Brasil)")
    assert len(en) == len(tx.components) >= 45
    texts = lambda updates: [v for u in updates for k, v in u.items() if k != "__type__"]
    assert all(texts(en)) and all(texts(pt))
    changed = sum(a != b for a, b in zip(texts(en), texts(pt)))
    same = {t(key) for key in ("prompt", "top_p", "pq")}
    assert changed == len(texts(en)) - sum(x in same for x in texts(en))  # everything else is translated
