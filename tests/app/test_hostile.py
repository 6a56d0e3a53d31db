"""A public audience, round three: markup in a replayed trace, a prompt that holds the server, replays that hold the
replay slot, uploads, a proxy's second header line and reloads of the allowed pair."""
import json
import re
import tempfile
from types import SimpleNamespace

import httpx
import pytest
from starlette.datastructures import Headers

from app import handlers, teach, ui
from app.limits import VisitorLimits, visitor_of
from app.pairs import PairManager
from app.race import advance, run, start_race
from app.teach import inspect
from app.trace import MAX_TRACE_BYTES, to_trace
from specdec_core import SpecConfig
from specdec_core.bench.startup import free_port

EVIL = '"><script>alert(1)</script><img src=x onerror=alert(1)>'
MARKUP = re.compile(r"<\s*(script|img)\b", re.I)


@pytest.fixture(scope="module")
def recorded(tiny) -> dict:
    """A real race's trace, sampled, with a tree (so that every field has values of its own), through JSON."""
    race = run(start_race(tiny, "hello there", SpecConfig(k=3, max_new_tokens=16, temperature=0.8, tree_nodes=6)))
    return json.loads(json.dumps(to_trace(race)))


def replayed(data, lang="en", speed=1000.0) -> list:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return list(teach.replay(f.name, speed, lang))


def page(shown: list) -> str:
    """Every piece of HTML the replay put on the page, and the inspector's for each round and node of its race."""
    html = [x for view in shown for x in (view.plain, view.spec, view.tree, view.summary) if isinstance(x, str)]
    race = shown[-1].state
    if race is not None and not isinstance(race, str) and getattr(race, "spec", None):
        for r, e in enumerate(race.spec.events, start=1):
            for pos in range(1, len(e.drafted) + 2):
                decision, _, tree = inspect(race, r, pos)
                html += [decision] + ([tree] if isinstance(tree, str) else [])
    return "".join(html)


def poisoned(recorded: dict):
    """(where, a copy of the trace with EVIL in that field): each event field, each top-level part."""
    for name in recorded["lanes"]["speculative"]["events"][0]:
        data = json.loads(json.dumps(recorded))
        for lane in data["lanes"].values():
            for e in lane["events"]:
                e[name] = [EVIL] * len(e[name]) if isinstance(e[name], list) and e[name] else EVIL
        yield f"event.{name}", data
    for part in ("meta", "settings", "labels"):
        data = json.loads(json.dumps(recorded))
        data[part] = {key: EVIL for key in data[part]}
        yield part, data
    for part in ("texts", "tail"):
        data = json.loads(json.dumps(recorded))
        for lane in data["lanes"].values():
            lane[part] = [EVIL] * len(lane[part]) if part == "texts" else EVIL
        yield part, data


def test_no_field_of_a_replayed_trace_reaches_the_page_as_markup(recorded):
    refused = []
    for where, data in poisoned(recorded):
        shown = replayed(data)
        assert not MARKUP.search(page(shown)), where
        refused += [where] if "Cannot replay" in shown[-1].summary else []
    # the text fields are shown, escaped; fields that must be numbers are refused
    assert "texts" not in refused and "labels" not in refused and "event.round" in refused


@pytest.mark.parametrize("damage", ["unknown_kind", "not_a_tree", "few_texts", "string_number", "string_round",
                                    "path_off_tree", "bad_finish", "short_probs"])
def test_traces_with_values_of_the_right_type_but_the_wrong_kind_are_refused(recorded, damage):
    data = json.loads(json.dumps(recorded))
    lane = data["lanes"]["speculative"]
    e = next(e for e in lane["events"] if len(e["drafted"]) > 1)
    if damage == "unknown_kind":
        e["token_kind"] = "mystery"
    elif damage == "not_a_tree":
        e["parents"] = [1] * len(e["drafted"])
    elif damage == "few_texts":
        lane["texts"] = lane["texts"][:2]
    elif damage == "string_number":
        e["p_drafted"] = ["high"] * len(e["drafted"])
    elif damage == "string_round":
        e["round"] = "7"
    elif damage == "path_off_tree":
        e["path"] = [len(e["drafted"]) - 1, 0]
    elif damage == "bad_finish":
        e["finish_reason"] = "<b>"
    elif damage == "short_probs":
        e["accept_probs"] = []
    shown = replayed(data, "pt")
    assert len(shown) == 1 and "Não é possível reproduzir" in shown[0].summary


def test_a_replay_ends_within_its_bound_at_any_speed(recorded, monkeypatch):
    """A trace whose clocks add up to hours, played at a quarter speed, keeps its replay slot two minutes at most."""
    data = json.loads(json.dumps(recorded))
    for lane in data["lanes"].values():
        for i, e in enumerate(lane["events"]):
            e["elapsed_s"] = 1000.0 * (i + 1)
    now = [0.0]
    monkeypatch.setattr(teach.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(teach.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    shown = replayed(data, speed=0.25)
    assert shown[-1].state.done and now[0] <= teach.MAX_REPLAY_S + 1


def test_replays_do_not_wait_for_each_other_and_uploads_are_capped():
    manager = PairManager("cpu", "float32")
    demo = ui.build_app(manager)
    replay = next(f for f in demo.fns.values() if f.name == "replay")
    assert replay.concurrency_id != "gpu" and (replay.concurrency_limit is None or replay.concurrency_limit >= 8)
    demo.queue()
    port = free_port()
    ui.launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        url = f"http://127.0.0.1:{port}/gradio_api/upload"
        small = httpx.post(url, files={"files": ("t.json", b"{}")})
        big = httpx.post(url, files={"files": ("t.json", b" " * (MAX_TRACE_BYTES + 1))})
        assert small.status_code == 200 and big.status_code == 413
    finally:
        demo.close()


def test_a_second_forwarded_line_from_a_proxy_is_read(monkeypatch):
    """A proxy that adds its own X-Forwarded-For line: the server sees two lines, and the visitor is in the last."""
    monkeypatch.setenv("SPECDEC_PROXY_HOPS", "1")
    headers = Headers(raw=[(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"8.8.4.4")])
    assert visitor_of(SimpleNamespace(headers=headers, client=SimpleNamespace(host="10.0.0.1"))) == "8.8.4.4"


def test_hosted_visitors_cannot_reload_pairs_at_will(monkeypatch):
    import app.pairs as pairs

    loads = []
    real = pairs.load_pair
    monkeypatch.setattr(pairs, "load_pair", lambda *a, **kw: (loads.append(a[0]), real(*a, **kw))[1])
    manager = PairManager("cpu", "float32", allow_custom=False, allowlist=frozenset({"tiny", "bundled"}))
    manager.load("tiny")
    first = manager.pair
    for _ in range(4):
        manager.load("tiny")  # the pair it serves: nothing to load
    assert loads == ["tiny"] and manager.pair is first and not manager.failed
    status = manager.load("bundled")  # another allowed pair, within the cool-down of the last load
    assert loads == ["tiny"] and "try again" in status and manager.pair is first


def test_hosted_prompts_are_capped_and_charged(tiny):
    limits = VisitorLimits(1000, max_prompt_tokens=200)
    manager = SimpleNamespace(pair=tiny, loading=False)
    shown = list(handlers.race_stream(manager, limits, "word " * 200, {"max_new_tokens": 8}))
    assert len(shown) == 1 and "200" in shown[0].summary and "prompt" in shown[0].summary
    shown = list(handlers.race_stream(manager, limits, "word " * 20, {"max_new_tokens": 8}))
    prompt = shown[-1].state.meta["prompt_tokens"]
    assert shown[-1].state.done and 20 <= prompt <= 200
    assert sum(t for _, t in limits._spent["local"]) == 2 * (prompt + 8)  # both decoders read the prompt


def test_a_long_prompt_says_what_it_will_cost_and_stop_ends_its_prefill(tiny, monkeypatch):
    """The prefill runs in chunks with a yield between them: the page says how long the prompt will take before the
    first chunk, and a generator closed there (Stop, a disconnect) runs no further forward."""
    from specdec_core import cache

    monkeypatch.setattr(cache, "PROMPT_CHUNK", 16)
    forwards = []  # every model's forward (on the class: a patched instance of the shared pair would stay patched)
    real = type(tiny.target).forward
    monkeypatch.setattr(type(tiny.target), "forward", lambda self, *a, **kw: (forwards.append(1), real(self, *a, **kw))[1])
    manager = SimpleNamespace(pair=tiny, loading=False)
    stream = handlers.race_stream(manager, None, "word " * 150, {"max_new_tokens": 8})
    first = next(stream)
    assert "Reading the prompt" in first.summary and not forwards
    for _ in range(6):  # the lanes' first chunks (the chat template's shared head is copied, not run)
        shown = next(stream)
    assert "Reading the prompt" in shown.summary and 0 < len(forwards) <= 6
    stream.close()
    assert len(forwards) <= 6  # of the 3 x 769 / 16 chunks the prompt would take


def test_a_pairs_first_race_says_it_times_the_passes_before_it_does(tiny, monkeypatch):
    """A pair's first race waits seconds while its passes are timed (Pair.costs): the page says so before they are,
    and later races, and drafters that time nothing, go straight to the race."""
    import dataclasses

    from specdec_core.models import pair as pair_module

    timed = []
    real = pair_module.tree_costs
    monkeypatch.setattr(pair_module, "tree_costs", lambda p: (timed.append(1), real(p))[1])
    manager = SimpleNamespace(pair=dataclasses.replace(tiny, pass_costs=None), loading=False)
    lookup = list(handlers.race_stream(manager, None, "word " * 10, {"max_new_tokens": 4, "drafter": "prompt-lookup"}))
    assert not timed and not any("Timing" in v.summary for v in lookup)
    stream = handlers.race_stream(manager, None, "word " * 10, {"max_new_tokens": 4})
    first = next(stream)
    assert "Timing this machine" in first.summary and not timed
    assert list(stream)[-1].state.done and timed == [1]
    again = list(handlers.race_stream(manager, None, "word " * 10, {"max_new_tokens": 4}))
    assert again[-1].state.done and timed == [1] and not any("Timing" in v.summary for v in again)
    api = SimpleNamespace(pair=dataclasses.replace(tiny, pass_costs=None), loading=False)  # the API: dicts only
    answers = list(handlers.api_generate(api, None, "word " * 10, {"max_new_tokens": 4}))
    assert all(isinstance(a, dict) for a in answers) and answers[-1]["done"] and timed == [1, 1]


@pytest.mark.parametrize("drafter, models", [("model", 3), ("early-exit", 3), ("hybrid", 3), ("prompt-lookup", 2)])
def test_a_prompts_readings_count_every_model_that_reads_it(tiny, drafter, models):
    """Plain decoding's target, speculative decoding's target, and its draft where the drafter runs a model (the
    early exit runs the target's first layers)."""
    race = start_race(tiny, "word " * 60, SpecConfig(max_new_tokens=4), drafter)
    left, read, _ = handlers.prefill_parts(race)
    assert read == 0 and left == models * (race.meta["prompt_tokens"] - 1)  # each reads all but the last token
    while not (race.plain.events and race.spec.events):
        advance(race)
    drafts = race.spec.prefilling.model == "draft"
    assert handlers.prefill_parts(race)[:2] == (0, (2 + drafts) * (race.meta["prompt_tokens"] - 1))
