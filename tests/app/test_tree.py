"""Token trees on screen: the drawing, clicking a node, the panes, traces and the theory panel."""
import dataclasses
import json
import re

from app import teach
from app.handlers import lane_pieces, view
from app.race import run, start_race
from app.trace import from_trace, replay_step, to_trace
from app.tree import layout, states, tree_html
from specdec_core import SpecConfig
from specdec_core.events import RoundEvent

from ..conftest import with_eos


def event(parents, path, drafted=None, token_kind="replacement", **kw):
    n = len(parents)
    values = dict(method="speculative", drafter="model", round=1, k=4, drafted=drafted or list(range(10, 10 + n)),
                  accepted=len(path), token=99, token_kind=token_kind, committed=[], p_drafted=[0.5] * n,
                  q_drafted=[1.0] * n, accept_probs=[0.5] * n, uniforms=[0.1] * n, p_token=1.0, greedy=True,
                  target_top=[[]] * (n + 1), draft_top=[[]] * n, residual_top=None, prefill_s=0.0, draft_s=0.0,
                  verify_s=0.0, overhead_s=0.0, elapsed_s=1.0, n_generated=1, parents=parents, path=path,
                  expected=1.5)
    return RoundEvent(**{**values, **kw})


def test_a_chain_is_one_row_and_each_branch_opens_a_row():
    assert layout([-1, 0, 1, 2]) == ([1, 2, 3, 4], [0, 0, 0, 0], 1)
    # root -> a -> b, root -> c; a -> d
    depth, row, rows = layout([-1, 0, -1, 0])
    assert depth == [1, 2, 1, 2] and rows == 3 and row[0] == row[1] == 0 and row[3] == 1 and row[2] == 2


def test_node_states_follow_the_rule():
    # root children 0, 1, 2; 1 accepted (0 rejected before it, 2 never judged); 1's children 3, 4: 3 rejected, 4 too
    e = event([-1, -1, -1, 1, 1, 0], [1])
    assert states(e) == ["rejected", "accepted", "unreached", "rejected", "rejected", "unreached"]


def test_the_drawing_marks_every_node_and_escapes_tokens():
    e = event([-1, -1, 0, 2], [0, 2], token_kind="bonus")
    labels = {10: "<b>", 11: "x", 12: "y", 13: "z", 99: "end"}
    drawn = tree_html(e, labels.get)
    assert "<b>" not in drawn and "&lt;b&gt;" in drawn
    assert len(re.findall(r'class="tn tn-', drawn)) == 5  # four nodes and the target's own token
    assert re.findall(r'data-pos="(\d+)"', drawn) == ["1", "2", "3", "4", "5"]
    assert drawn.count("tn-accepted") == 3 and drawn.count("te-on") == 3  # two on the path, and the legend
    assert tree_html(event([-1, 0], [0]), str, "pt").count("caminho aceito") == 1
    boxes = lambda drawn: re.findall(r'<rect x="(\d+)" y="(\d+)"', drawn)
    rejected_at_root = tree_html(event([-1, -1, 0], []), str)  # both first choices rejected
    assert len(set(boxes(rejected_at_root))) == 4  # the target's token has a place of its own
    assert tree_html(None, str) == "" and tree_html(dataclasses.replace(event([], []), drafted=[]), str) == ""
    chain = tree_html(event([-1, 0, 1], [0]), str)  # a chain is the tree with one branch: one straight row
    assert len(boxes(chain)) == 4 and len({y for _, y in boxes(chain)[:3]}) == 1 and "tn-rejected" in chain


def test_a_tree_race_draws_its_rounds_and_every_node_opens_the_inspector(tiny):
    cfg = SpecConfig(k=4, max_new_tokens=40, tree_nodes=12, record_top=5)
    race = run(start_race(with_eos(tiny, []), "hello", cfg))
    assert race.identical
    shown = view(race)
    last = [e for e in race.spec.events if e.drafted][-1]  # a round with room for one token drafts none
    assert shown.tree == tree_html(last, race.label) and f'data-round="{last.round}"' in shown.tree
    e = max(race.spec.events, key=lambda e: len(set(e.parents)))  # a round that branched
    seen = set()
    for i, kind in enumerate(states(e)):
        _, _, _, text, fig, tree = teach.pick(race, f"{e.round},{i + 1},1", "en")
        expected = {"accepted": "equal: accepted", "rejected": "different: rejected",
                    "unreached": "Not judged"}[kind]
        assert expected in text and f"drafted token {i + 1} of {len(e.drafted)}" in text, (kind, text)
        assert tree == tree_html(e, race.label) and fig.data  # the inspected round's tree, its p and q bars
        seen.add(kind)
    assert {"accepted", "rejected", "unreached"} <= seen
    # the pane's accepted tokens point at nodes on the path
    for piece in lane_pieces(race, race.spec):
        if piece.kind == "accepted":
            assert piece.pos - 1 in race.spec.events[piece.round - 1].path
    assert "bonus token" in teach.pick(race, f"{e.round},{len(e.drafted) + 1},2", "en")[3] or "own token" in \
        teach.pick(race, f"{e.round},{len(e.drafted) + 1},2", "en")[3]


def test_a_tree_trace_replays_to_the_same_drawing(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=3, max_new_tokens=30, temperature=0.8, seed=2, tree_nodes=8)))
    replayed, timeline = from_trace(json.loads(json.dumps(to_trace(race))))
    for item in timeline:
        replay_step(replayed, item)
    assert replayed.spec.events == race.spec.events
    assert view(replayed).tree == view(race).tree != ""
    assert teach.inspect(replayed, 2, 1)[2] == teach.inspect(race, 2, 1)[2]


def test_the_theory_panel_puts_the_trees_expectation_beside_the_measurement(tiny):
    race = run(start_race(tiny, "hello", SpecConfig(k=4, max_new_tokens=30, tree_nodes=10)))
    fig = teach.theory(race, "en")
    expected, measured = fig.data
    rounds = [e for e in race.spec.events if e.drafted]  # a last round with room for one token drafts nothing
    assert list(expected.x) == list(measured.x) == [e.round for e in rounds]
    assert list(expected.y) == [e.expected for e in rounds] and list(measured.y) == [e.accepted for e in rounds]
    assert "expected" in expected.name and "measured" in measured.name
