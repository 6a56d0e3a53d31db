"""Load and faults against a running app.py (tiny pair): a full queue, and memory over 200 generations."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .apprun import OUTPUT, AppProcess

LONG_PROMPT = "Count to a thousand."  # greedy runs on the tiny pair go on to max_new_tokens


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture
def small_queue_app():
    proc = AppProcess("--queue-size", "1")
    yield proc
    proc.stop()


def test_a_full_queue_is_reported_and_the_rest_are_served(small_queue_app):
    small_queue_app.client()

    def ask(i):
        try:
            small_queue_app.client().predict(LONG_PROMPT, k=1, max_new_tokens=1024, api_name="/generate")
            return "ok"
        except Exception as err:  # the client raises what the server said
            return str(err)

    with ThreadPoolExecutor(5) as pool:
        outcomes = list(pool.map(ask, range(5)))
    assert "ok" in outcomes
    assert any("full" in o.lower() for o in outcomes if o != "ok"), outcomes


def test_memory_stays_flat_over_200_generations():
    proc = AppProcess()
    try:
        client = proc.client()
        for i in range(20):  # warm-up: allocator pools and caches settle
            client.predict(f"warm {i}", max_new_tokens=8, api_name="/generate")
        before = rss_mb(proc.proc.pid)
        for i in range(200):
            assert client.predict(f"request {i}", k=3, max_new_tokens=8, api_name="/generate")["stats"]["tokens"] >= 1
        after = rss_mb(proc.proc.pid)
    finally:
        proc.stop()
    (OUTPUT / "memory.txt").write_text(f"RSS after 20 warm-up generations: {before:.1f} MB\n"
                                       f"RSS after 200 more: {after:.1f} MB\n")
    assert after - before < 40, (before, after)
