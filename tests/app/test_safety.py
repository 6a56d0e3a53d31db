"""Surviving a public audience: model-id checks, failed loads, limits, NaN logits, EOS edge cases."""
import dataclasses
import threading
from types import SimpleNamespace

import gradio as gr
import pytest
import torch

from app import handlers
from app.handlers import api_generate
from app.i18n import said
from app.limits import VisitorLimits
from app.pairs import PairManager, check_model_id, judge_model_info, parse_spec
from app.race import advance, run, start_race
from app.ui import status_html
from specdec_core import SpecConfig, generate
from specdec_core.models.tiny import tiny_models
from specdec_core.sampling import NonFiniteLogitsError

from ..conftest import with_eos

GB = 1e9


def info(archs=("Qwen2ForCausalLM",), files=(("model.safetensors", 3 * GB),), gated=False, **config):
    return SimpleNamespace(config={"architectures": list(archs), **config}, gated=gated,
                           siblings=[SimpleNamespace(rfilename=n, size=s) for n, s in files])


@pytest.mark.parametrize("meta, reason", [
    (info(), None),
    (info(gated="manual"), "gated"),
    (info(auto_map={"AutoModelForCausalLM": "x.Model"}), "remote"),
    (info(archs=("BertForMaskedLM",)), "not a causal language model"),
    (info(archs=()), "not a causal language model"),
    (info(files=(("pytorch_model.bin", GB),)), "safetensors"),
    (info(files=(("a.safetensors", 30 * GB), ("b.safetensors", 30 * GB))), "budget"),
])
def test_hub_metadata_is_judged_before_download(meta, reason, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    verdict = judge_model_info("org/model", meta, 40 * GB)
    assert verdict is None if reason is None else reason in str(verdict)


def test_local_dirs_with_only_pickle_weights_are_refused(tmp_path):
    target, _, _ = tiny_models()
    target.config.save_pretrained(tmp_path)
    torch.save(target.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        check_model_id(str(tmp_path), 40 * GB, local=True)


@pytest.mark.parametrize("spec", ["", "onlyone", ",x", "a,"])
def test_pair_specs_are_parsed_with_a_message(spec):
    with pytest.raises(ValueError, match="TARGET_ID,DRAFT_ID.*ollama:NAME:TAG"):
        parse_spec(spec)


def test_a_failed_load_leaves_the_previous_pair_serving():
    manager = PairManager("cpu", "float32")
    assert manager.load("tiny").startswith("Ready")
    pair = manager.pair
    status = manager.load("no-such-org/no-such-model,no-such-org/other")  # offline or missing: either way refused
    assert "Could not load" in status and "Still serving" in status
    assert manager.pair is pair
    assert "msg-error" in status_html(manager)  # the status says it failed by a field, not by its wording
    manager.say("status_failed", spec="a pair", reason="only text here")
    manager.failed = False
    assert "msg-info" in status_html(manager)
    assert generate(pair, "still works", SpecConfig(max_new_tokens=4)).token_ids


def test_hosted_mode_refuses_unlisted_models():
    manager = PairManager("cpu", "float32", allow_custom=False, allowlist=frozenset({"ok/target", "ok/draft"}))
    assert "not among them" in manager.load("evil/model,ok/draft")
    manager.check_allowed("ok/target,ok/draft")  # listed: allowed through to the hub checks


def test_switching_pairs_mid_generation_does_not_disturb_the_running_one(tiny):
    manager = PairManager("cpu", "float32")
    manager.load("tiny")
    pair = with_eos(manager.pair, [])
    cfg = SpecConfig(k=3, max_new_tokens=40)
    race = start_race(pair, "hello", cfg)
    for _ in range(5):
        advance(race)
    loader = threading.Thread(target=manager.load, args=("tiny",))
    loader.start()
    run(race)
    loader.join()
    assert manager.pair is not pair and race.identical is True
    assert race.spec.token_ids == generate(pair, "hello", cfg).token_ids


def test_visitor_limits():
    limits = VisitorLimits(tokens_per_hour=100)
    with limits.admit("a", 60):
        with pytest.raises(ValueError, match="already have a generation") as refused:
            with limits.admit("a", 10):
                pass
        assert "Você já tem uma geração" in said(refused.value, "Português (Brasil)")  # in the visitor's language
        with limits.admit("b", 60):  # another visitor is independent
            pass
    with pytest.raises(ValueError, match="allowance") as refused:
        with limits.admit("a", 60):
            pass
    assert "100 tokens por hora" in said(refused.value, "pt")
    with limits.admit("a", 40):  # what is left still works
        pass


def test_nan_logits_are_reported_never_sampled(tiny):
    target, draft, tok = tiny_models()
    with torch.no_grad():
        target.lm_head.weight[5].fill_(float("nan"))
    pair = dataclasses.replace(tiny, target=target, draft=draft)
    with pytest.raises(NonFiniteLogitsError):
        generate(pair, "hello", SpecConfig(max_new_tokens=5))
    manager = SimpleNamespace(pair=pair, status="", loading=False)
    with pytest.raises(gr.Error, match="NaN"):
        list(api_generate(manager, None, "hello", dict(k=4, max_new_tokens=5, drafter="model")))
    shown = list(handlers._drive(start_race(pair, "hello", SpecConfig(max_new_tokens=5)), "pt"))
    assert "Parado: o modelo produziu logits NaN" in shown[-1].summary  # the page says it in its language


def test_eos_as_the_very_first_token(tiny):
    pair = with_eos(tiny, [])
    first = generate(pair, "hello", SpecConfig(max_new_tokens=5), "autoregressive").token_ids[0]
    for method in ("speculative", "autoregressive"):
        out = generate(with_eos(pair, [first]), "hello", SpecConfig(k=4, max_new_tokens=50), method)
        assert out.token_ids == [first] and out.stats.finish_reason == "eos"


def test_same_model_as_draft_and_target_accepts_everything(tiny):
    pair = with_eos(dataclasses.replace(tiny, draft=tiny.target), [])
    out = generate(pair, "hello", SpecConfig(k=5, max_new_tokens=30, temperature=0.9, seed=1))
    assert out.stats.acceptance_rate == 1.0


def test_the_pair_status_speaks_the_visitors_language():
    """Every status the pair manager reports is said in both languages (none stays English in Portuguese)."""
    manager = PairManager("cpu", "float32")
    said = {"none": (manager.status_text("en"), manager.status_text("pt"))}
    manager.load_in_background("tiny").join()
    said["ready"] = (manager.status_text("en"), manager.status_text("pt"))
    manager.load("no-such-org/no-such-model,no-such-org/other")
    said["failed"] = (manager.status_text("en"), manager.status_text("pt"))
    manager.say("status_replay")
    said["replay"] = (manager.status_text("en"), manager.status_text("pt"))
    manager.say("status_progress", message="joining", fraction=0.5)
    said["progress"] = (manager.status_text("en"), manager.status_text("pt"))
    assert said["ready"][0].startswith("Ready: ") and said["ready"][1].startswith("Pronto: ")
    assert "Could not load" in said["failed"][0] and "Não foi possível carregar" in said["failed"][1]
    for name, (en, pt) in said.items():
        assert en != pt, name
    assert manager.status == manager.status_text("en")  # the English text stays for logs and the terminal
    assert "Carregando: joining (50%)" in status_html(manager, "Português (Brasil)")


def test_gguf_files_on_the_servers_disk_are_read_only_where_the_operator_allows(tmp_path, monkeypatch):
    """A path or an Ollama name is refused alike whether it exists or not (no answer tells what the disk holds),
    unless the operator started the app with --local-models; a Hub quant needs the allowlist in hosted mode."""
    from ..core.models.test_gguf_model import write_gguf
    from ..core.models.test_gguf_pairs import random_model

    path = write_gguf(random_model("qwen2", 1), tmp_path / "m.gguf")[0]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    manager = PairManager("cpu", "float32")
    for spec in (f"{path},{path}", f"{tmp_path / 'none.gguf'},{path}", "ollama:qwen2.5,ollama:qwen2.5:0.5b"):
        assert "--local-models" in manager.load(spec) and manager.pair is None
    assert manager.load(f"{path},{path}", local=True).startswith("Ready")
    assert manager.pair.info.target == "m.gguf"
    hosted = PairManager("cpu", "float32", allow_custom=False, allowlist=frozenset({"a/b-GGUF:q4_k_m"}))
    assert "not among them" in hosted.load("a/b-GGUF:q4_k_m,c/d-GGUF:q8_0")
