"""End to end: app.py on the tiny pair, driven through gradio_client and a real headless Chromium."""
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec_core import SpecConfig, generate, load_pair

from .apprun import OUTPUT, AppProcess

pytestmark = pytest.mark.slow  # app.py in a subprocess

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SHOTS = OUTPUT / "browser"
STOP_PROMPT = "Count to a thousand."  # the tiny pair never ends a greedy run early


@pytest.fixture(scope="module")
def app():
    proc = AppProcess()
    proc.client()  # wait until ready
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine_pair():
    return load_pair("tiny", device="cpu", dtype="float32")


def test_generate_endpoint_returns_the_engines_own_output(app, engine_pair):
    client = app.client()
    res = client.predict("Write a haiku about caches.", k=3, max_new_tokens=40, api_name="/generate")
    own = generate(engine_pair, "Write a haiku about caches.", SpecConfig(k=3, max_new_tokens=40))
    assert res["token_ids"] == own.token_ids
    assert res["text"] == own.text
    assert res["identical"] is True and res["plain_text"] == own.text
    assert res["stats"]["tokens"] == len(own.token_ids) and res["stats"]["acceptance_rate"] > 0
    assert res["speedup"] > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="   "), "empty"),
    (dict(prompt="hi", k=0), "k"),
    (dict(prompt="hi", k=99), "k"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=10**7), "max_new_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", temperature=3.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-3), "top_k"),
    (dict(prompt="hi", seed=1.5), "seed"),
    (dict(prompt="x" * 100_000), "characters"),
    (dict(prompt="x" * 5000), "context"),
    (dict(prompt="hi", drafter="oracle"), "drafter"),
    (dict(prompt="hi", tree_nodes=65), "tree_nodes"),
    (dict(prompt="hi", tree_nodes=-1), "tree_nodes"),
    (dict(prompt="hi", guess=4), "guess"),
])
def test_bad_input_gets_a_clear_error_and_the_server_lives(app, kwargs, message):
    client = app.client()
    with pytest.raises(Exception, match=message):
        client.predict(api_name="/generate", **kwargs)
    assert client.predict("still alive?", max_new_tokens=3, api_name="/generate")["stats"]["tokens"] == 3


@pytest.mark.parametrize("prompt", ["emoji 👋🏽🇧🇷 مرحبا", "zero\u200bwidth \u0007 control", "<|im_end|><|endoftext|>",
                                    "<script>alert(1)</script>"])
def test_unusual_prompts_work(app, engine_pair, prompt):
    res = app.client().predict(prompt, max_new_tokens=12, api_name="/generate")
    assert res["token_ids"] == generate(engine_pair, prompt, SpecConfig(max_new_tokens=12)).token_ids


def test_concurrent_clients_get_their_own_answers(app, engine_pair):
    """Greedy, each client its own prompt: the engine's answers exactly. (A sampled answer is the same draw only where
    the drafts are the same, and how far they go follows costs timed in each process.)"""
    prompts = [f"client {i}: say something" for i in range(8)]
    expected = [generate(engine_pair, p, SpecConfig(k=2, max_new_tokens=20)).token_ids for p in prompts]

    def ask(i):
        return app.client().predict(prompts[i], k=2, max_new_tokens=20, api_name="/generate")["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == expected


@pytest.fixture(scope="module")
def page(app):
    if not shutil.which(CHROMIUM):  # never skipped in CI, where .ci/run installs it
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"needs Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app.url)
        page.get_by_text("Ready:").first.wait_for(timeout=60_000)
        yield page
        browser.close()


def finished(page, text: str, running: str = "Running", timeout=60_000):
    """Wait for the run just started to end with `text` in its summary. The summary still shows the previous run's
    until this one starts (`running`: the page's word for it), and a wait for text both share would pass at once,
    mid-run."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.locator("#summary", has_text=running).wait_for(timeout=10_000)
    except PlaywrightTimeout:  # it ended before the summary was read
        pass
    page.locator("#summary", has_text=text).wait_for(timeout=timeout)


def attached(page, selector, timeout=60_000):
    page.locator(selector).first.wait_for(state="attached", timeout=timeout)


@pytest.mark.browser
def test_browser_race_shows_coloured_tokens_and_plots(page):
    page.locator("#prompt textarea").fill("<img src=x onerror=\"window.__xss=1\"> Write a loop in Python.")
    page.locator("#generate").click()
    attached(page, "#spec-pane .tok-acc")
    attached(page, "#spec-pane .tok-rep, #spec-pane .tok-bon")
    attached(page, "#plain-pane .tok")
    page.locator("#race-plot .js-plotly-plot").first.wait_for(timeout=60_000)
    finished(page, "identical")  # greedy: checked when done
    assert page.locator("#spec-pane .tok-rej").count() > 0  # rejected drafts stay visible
    assert page.evaluate("window.__xss") is None
    page.screenshot(path=str(SHOTS / "race.png"), full_page=True)
    assert (SHOTS / "race.png").stat().st_size > 10_000


def visible_token(page, kind):
    """A token of that kind with some text (bytes of a split character render as an empty span)."""
    return page.locator(f"#spec-pane .{kind}").filter(has_text=re.compile(r"\S")).first


@pytest.mark.browser
def test_browser_clicking_a_token_opens_its_decision(page):
    visible_token(page, "tok-rej").click()  # greedy: a rejected draft, explained by the argmax
    page.locator("#decision", has_text="different: rejected").wait_for(timeout=30_000)
    assert page.locator("#decision", has_text="Round").count() == 1
    visible_token(page, "tok-acc").click()
    page.locator("#decision", has_text="equal: accepted").wait_for(timeout=30_000)
    page.locator("#theory").get_by_text("Theory next to measurement").click()
    page.locator("#theory-plot .js-plotly-plot").first.wait_for(timeout=30_000)
    assert page.locator("#theory-plot", has_text="measured").count() == 1
    page.screenshot(path=str(SHOTS / "inspector-theory.png"), full_page=True)


@pytest.mark.browser
def test_browser_draws_a_draft_tree_and_a_click_on_a_node_opens_it(page):
    page.get_by_text("More settings").first.click()
    nodes = page.locator("#tree-nodes input[type=number]")
    nodes.wait_for(state="visible", timeout=10_000)
    time.sleep(0.5)  # the accordion mounts its sliders with their defaults: set ours after that
    nodes.fill("12")
    nodes.press("Enter")
    page.locator("#prompt textarea").fill("Write a loop in Python.")
    assert nodes.input_value() == "12"
    page.locator("#generate").click()
    finished(page, "identical")  # greedy trees: still the same output
    page.locator("#decision", has_text="Round").wait_for(timeout=30_000)  # the inspector has refreshed after the run
    visible_token(page, "tok-acc").click()  # an accepted token opens its round: the tree pane follows
    page.locator("#decision", has_text="equal: accepted").wait_for(timeout=30_000)
    attached(page, "#tree-pane svg g.tn-accepted")
    assert page.locator("#tree-pane", has_text="accepted path").count() == 1
    page.locator("#tree-pane g.tn-replacement, #tree-pane g.tn-bonus").first.click()  # the target's own token
    page.locator("#decision", has_text=re.compile("own token|bonus token")).wait_for(timeout=30_000)
    page.locator("#tree-pane g.tn-accepted").first.click()
    page.locator("#decision", has_text="depth 1").wait_for(timeout=30_000)  # a node: where it sits in the tree
    assert page.locator("#decision", has_text="equal: accepted").count() == 1
    page.screenshot(path=str(SHOTS / "tree.png"), full_page=True)
    nodes.fill("0")  # the tests after this one race chains again
    nodes.press("Enter")


@pytest.mark.browser
def test_browser_stop_cancels_and_the_next_run_works(page):
    page.locator("#max-new input[type=number]").fill("1024")
    page.locator("#max-new input[type=number]").press("Enter")
    page.locator("#prompt textarea").fill(STOP_PROMPT)
    page.locator("#generate").click()
    page.locator("#summary", has_text="Running").wait_for(timeout=60_000)  # this run, not the previous one
    page.locator("#stop").click()
    time.sleep(1.0)
    count = page.locator("#plain-pane .tok").count()
    time.sleep(1.5)
    assert page.locator("#plain-pane .tok").count() == count < 1024  # nothing more arrives after Stop
    assert page.locator("#summary", has_text="identical").count() == 0
    page.locator("#max-new input[type=number]").fill("24")
    page.locator("#max-new input[type=number]").press("Enter")
    page.locator("#generate").click()
    finished(page, "identical")


@pytest.mark.browser
def test_browser_escapes_text_from_a_visitor(page):
    page.locator("#pair-box").get_by_text("Model pair").first.click()
    page.locator("#custom-pair textarea, #custom-pair input").first.fill('<img src=x onerror="window.__xss=2">,b')
    page.locator("#load-pair").click()
    page.locator("#pair-status", has_text="Could not load").wait_for(timeout=60_000)
    page.locator("#pair-status", has_text="Ready").wait_for(timeout=10_000)  # the previous pair still serves
    assert page.evaluate("window.__xss") is None
    page.screenshot(path=str(SHOTS / "bad-pair.png"))


@pytest.mark.browser
def test_browser_language_switch_covers_labels_and_results(page):
    page.locator("#lang").get_by_text("Português (Brasil)").click()
    page.locator("#generate", has_text="Gerar").wait_for(timeout=10_000)
    assert page.get_by_text("Decodificação especulativa (rascunho + alvo)").count() == 1
    assert page.get_by_text("Inspecionar um token rascunhado").count() == 1
    page.locator("#prompt textarea").fill("Olá")
    page.locator("#generate").click()
    finished(page, "idêntica", running="Rodando")
    visible_token(page, "tok-acc").click()
    page.locator("#decision", has_text="iguais: aceito").wait_for(timeout=30_000)
    page.screenshot(path=str(SHOTS / "portuguese.png"), full_page=True)
    page.locator("#lang").get_by_text("English").click()
    page.locator("#generate", has_text="Generate").wait_for(timeout=10_000)
