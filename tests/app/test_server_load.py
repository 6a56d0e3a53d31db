"""Load and faults against a running app.py (tiny pair): a full queue, and memory over 200 generations."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .apprun import OUTPUT, AppProcess

pytestmark = pytest.mark.slow  # app.py in a subprocess, under load

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
    # connect first: client() retries until served, so it must not be what sends the long requests
    clients = [small_queue_app.client() for _ in range(5)]

    def ask(client):
        try:
            client.predict(LONG_PROMPT, k=1, max_new_tokens=1024, api_name="/generate")
            return "ok"
        except Exception as err:  # the client raises what the server said
            return str(err)

    with ThreadPoolExecutor(5) as pool:
        outcomes = list(pool.map(ask, clients))
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


def test_hosted_mode_limits_visitors_and_a_closed_tab_frees_its_generation():
    """One generation per visitor in hosted mode; closing the tab cancels the running one."""
    import os
    import shutil
    import time

    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if not shutil.which(chromium):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("needs Chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    # two generations may run at once, so only the per-visitor rule can refuse the second one
    proc = AppProcess("--concurrency", "2", env={"SPECDEC_HOSTED": "1", "SPECDEC_VISITOR_TOKENS": "100000"})
    try:
        client = proc.client()  # ready now; client() itself retries, so later calls use this one directly
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu",
                                                                          "--disable-background-networking"])
            page = browser.new_page()
            page.goto(proc.url)
            page.get_by_text("Ready:").first.wait_for(timeout=60_000)
            page.locator("#pair-box").get_by_text("Model pair").first.click()
            page.locator("#load-pair").wait_for(timeout=10_000)
            assert not page.locator("#custom-pair textarea").is_visible()  # no custom ids when hosted
            page.locator("#max-new input[type=number]").fill("1024")
            page.locator("#max-new input[type=number]").press("Enter")
            page.locator("#k input[type=number]").fill("1")  # K = 1: the longest race
            page.locator("#k input[type=number]").press("Enter")
            page.locator("#prompt textarea").fill(LONG_PROMPT)
            page.locator("#generate").click()
            page.locator("#plain-pane .tok").first.wait_for(state="attached", timeout=60_000)
            with pytest.raises(Exception, match="already have a generation running"):
                client.predict("second", max_new_tokens=2, api_name="/generate")
            page.close()  # the visitor leaves mid-generation
            time.sleep(1.5)
            assert client.predict("after", max_new_tokens=2, api_name="/generate")["stats"]["tokens"] == 2
            browser.close()
    finally:
        proc.stop()
