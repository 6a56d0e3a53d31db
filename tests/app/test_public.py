"""A public audience, round two: cancelled work, forged addresses, nested status, traces, the API's prompt,
server directories, presets in hosted mode and quiet refusals."""
import gc
import importlib.util
import json
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app import handlers, teach
from app import trace as traces
from app.limits import visitor_of
from app.pairs import PairManager, check_model_id
from app.settings import ask
from app.race import run, start_race
from app.trace import from_trace, to_trace
from app.ui import build_app
from specdec_core import SpecConfig
from specdec_core.bench.startup import free_port
from specdec_core.models.tiny import tiny_models


def script():
    """app.py, the script (the name `app` is the package)."""
    spec = importlib.util.spec_from_file_location("app_script", Path(__file__).resolve().parents[2] / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served():
    """The app on the tiny pair, in this process, so that the work its generations do can be counted."""
    manager = PairManager("cpu", "float32")
    manager.load("tiny")
    calls = {"n": 0}
    forward = manager.pair.target.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    manager.pair.target.forward = counted
    demo = build_app(manager)
    demo.queue(default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True)
    from gradio_client import Client

    yield SimpleNamespace(client=Client(f"http://127.0.0.1:{port}/", verbose=False), calls=calls, demo=demo)
    demo.close()


def settled(calls, quiet_s=1.0, limit_s=20.0) -> int:
    """The call count once it stops moving for `quiet_s` (or after `limit_s`)."""
    deadline, last = time.monotonic() + limit_s, -1
    while time.monotonic() < deadline and calls["n"] != last:
        last = calls["n"]
        time.sleep(quiet_s)
    return calls["n"]


def test_a_cancelled_api_generation_stops_working(served):
    out = served.client.predict("hello", max_new_tokens=8, api_name="/generate")
    assert len(out["token_ids"]) == 8 and out["identical"] is True  # the streamed API still ends with its answer
    for _ in range(3):
        job = served.client.submit("Count to a thousand.", k=1, max_new_tokens=1024, api_name="/generate")
        started = served.calls["n"]
        while served.calls["n"] < started + 5:  # running now
            time.sleep(0.02)
        job.cancel()
    before = settled(served.calls)
    time.sleep(1.5)
    assert served.calls["n"] == before  # nothing runs for visitors who left
    assert before < 3 * 2 * 1024  # and the three cancelled runs ended early, not after their 1,024 tokens


@pytest.mark.slow
def test_a_disconnected_api_client_stops_the_work(served):
    """A client killed mid-generation (no cancel sent): its generation ends with the connection."""
    url = served.client.src
    code = (f"from gradio_client import Client; import time; c = Client({url!r}, verbose=False); "
            "c.submit('Count to a thousand.', k=1, max_new_tokens=1024, api_name='/generate'); time.sleep(60)")
    start = served.calls["n"]
    client = subprocess.Popen([sys.executable, "-c", code])
    while served.calls["n"] < start + 20:
        time.sleep(0.02)
    client.kill()
    client.wait()
    assert settled(served.calls) < start + 2 * 1024 / 2  # far fewer passes than its 1,024 tokens take


def test_stop_cancels_a_replay(served):
    config = served.demo.config
    names = {d["id"]: d for d in config["dependencies"]}
    stop = next(d for d in config["dependencies"] if d["cancels"])
    replay = next(c for c in config["components"] if c.get("props", {}).get("value") == "Replay")
    replays = [i for i, d in names.items() if any(t[0] == replay["id"] for t in d["targets"])]
    assert replays and set(replays) <= set(stop["cancels"])


def request(forwarded: str, host: str = "10.0.0.1"):
    return SimpleNamespace(headers={"x-forwarded-for": forwarded} if forwarded else {}, client=SimpleNamespace(host=host))


def test_a_visitor_cannot_forge_its_address(monkeypatch):
    monkeypatch.setenv("SPECDEC_PROXY_HOPS", "1")  # one trusted proxy appends the client's address
    assert {visitor_of(request(f"{i}.{i}.{i}.{i}, 8.8.4.4")) for i in range(5)} == {"8.8.4.4"}
    assert visitor_of(request("8.8.4.4")) == "8.8.4.4"
    monkeypatch.setenv("SPECDEC_PROXY_HOPS", "0")  # no proxy: the header is the visitor's own text
    assert visitor_of(request("1.2.3.4")) == "10.0.0.1"
    monkeypatch.delenv("SPECDEC_PROXY_HOPS")
    monkeypatch.setenv("SPACE_ID", "someone/space")  # Spaces put one proxy in front
    assert visitor_of(request("6.6.6.6, 8.8.4.4")) == "8.8.4.4"


def test_failed_loads_do_not_nest_and_echo_little():
    manager = PairManager("cpu", "float32")
    manager.load("tiny")
    for _ in range(20):
        status = manager.load("x" * 20_000 + ",y")
    assert status.count("Still serving") == 1 and status.count("Could not load") == 1
    assert len(status) < 800, len(status)


def test_echoed_values_are_cut():
    with pytest.raises(ValueError) as err:
        ask({"k": "9" * 100_000})
    assert len(str(err.value)) < 300


def trace(tiny) -> dict:
    data = to_trace(run(start_race(tiny, "hello", SpecConfig(k=3, max_new_tokens=12))))
    return json.loads(json.dumps(data))


def replayed(text: str, lang="en") -> list:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(text)
    return list(teach.replay(f.name, 1000.0, lang))


def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("damage", ["settings_type", "deep", "many_drafted", "infinite_time", "events_type",
                                    "labels_type"])
def test_malformed_traces_are_refused_in_the_visitors_language(tiny, damage):
    data = trace(tiny)
    events = data["lanes"]["speculative"]["events"]
    if damage == "settings_type":
        data["settings"] = "k=3"
    elif damage == "deep":
        data["meta"] = json.loads(deep(500))
        text = json.dumps(data).replace('"meta": ' + deep(500), '"meta": ' + deep(100_000))
    elif damage == "many_drafted":
        events[0]["drafted"] = [1] * 100_000
    elif damage == "infinite_time":
        events[0]["elapsed_s"] = float("inf")
    elif damage == "events_type":
        data["lanes"]["plain"]["events"] = 7
    elif damage == "labels_type":
        data["labels"] = [1, 2]
    text = text if damage == "deep" else json.dumps(data)
    with pytest.raises(ValueError):
        from_trace(text)
    shown = replayed(text, "pt")
    assert len(shown) == 1 and "Não é possível reproduzir" in shown[0].summary


def test_a_replay_lasts_at_most_as_long_as_a_real_race(tiny):
    data = trace(tiny)
    for lane in data["lanes"].values():
        lane["events"][-1]["elapsed_s"] = 1e6  # 35 hours
    _, timeline = from_trace(json.dumps(data))
    tokens = sum(len(e.committed) for _, e, _, _ in timeline)
    assert max(e.elapsed_s for _, e, _, _ in timeline) <= 2.0 * tokens


def test_a_huge_trace_is_refused_before_it_is_read(tiny):
    data = trace(tiny)
    data["meta"]["padding"] = "x" * (getattr(traces, "MAX_TRACE_BYTES", 5_000_000) + 1)
    shown = replayed(json.dumps(data))
    assert len(shown) == 1 and "Cannot replay" in shown[0].summary and "MB" in shown[0].summary


def test_the_api_takes_text_only():
    manager = PairManager("cpu", "float32")
    manager.load("tiny")
    for prompt in ([151644, 258], {"text": "hi"}, 3, None):
        with pytest.raises(gr.Error, match="prompt"):
            list(handlers.api_generate(manager, None, prompt, {}))


@pytest.fixture
def model_dir(tmp_path):
    target, _, _ = tiny_models()
    target.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_server_directories_load_only_when_the_operator_allows(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as there:
        check_model_id(str(model_dir), 40e9)
    with pytest.raises(ValueError) as missing:
        check_model_id(str(tmp_path / "nothing-here"), 40e9)
    # refused alike: the message does not tell which server paths exist
    assert str(there.value).replace(str(model_dir), "P") == str(missing.value).replace(str(tmp_path / "nothing-here"), "P")
    check_model_id(str(model_dir), 40e9, local=True)  # allowed by the operator: loads


def test_share_means_hosted_and_presets_obey_the_allowlist(monkeypatch):
    for name in ("SPECDEC_HOSTED", "SPACE_ID", "SPECDEC_SHARE", "SPECDEC_LOCAL_MODELS"):
        monkeypatch.delenv(name, raising=False)
    assert script().options(["--share"]).hosted
    assert not script().options([]).hosted
    assert script().options(["--local-models"]).local_models and not script().options([]).local_models
    manager = PairManager("cpu", "float32", allow_custom=False, allowlist=frozenset({"bundled"}))
    assert "not among them" in manager.load("tiny")
    manager.check_allowed("bundled")


def test_collection_is_back_on_once_the_pair_has_loaded():
    """app.py starts with the cyclic collector off (a start makes a million objects and frees few) and turns it back
    on when the pair has loaded, with start-up's garbage collected: a server left without it would never free a
    cycle again."""
    class Node:
        pass

    loaded = threading.Event()
    load = threading.Thread(target=loaded.wait)
    load.start()
    gc.disable()
    try:
        cycle = Node()
        cycle.me, alive = cycle, weakref.ref(cycle)
        del cycle
        settler = threading.Thread(target=script().settle_memory, args=(load,))
        settler.start()
        time.sleep(0.3)
        assert settler.is_alive() and not gc.isenabled() and alive() is not None  # still loading: nothing collected
        loaded.set()
        settler.join(30)
        assert gc.isenabled() and alive() is None and gc.get_freeze_count() == 0  # nothing kept from collection
    finally:
        loaded.set()
        gc.enable()


def test_a_refusal_is_one_log_line(capfd):
    manager = PairManager("cpu", "float32")
    manager.load("tiny")
    with pytest.raises(gr.Error) as err:
        list(handlers.api_generate(manager, None, "hi", {"k": 999}))
    assert err.value.print_exception is False  # Gradio prints no traceback for it
    logged = capfd.readouterr()
    assert logged.out.count("\n") + logged.err.count("\n") <= 2 and "refused" in logged.out + logged.err
