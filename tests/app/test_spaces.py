"""Hugging Face Spaces: ZeroGPU lends a GPU only inside functions wrapped by `spaces.GPU`, and only
while they run; a dedicated GPU Space has one all the time. The `spaces` package is faked here as
far as its documented behaviour goes: a decorator, with or without a duration, on plain and
generator functions."""
import dataclasses
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from app import handlers
from app.i18n import t
from app.pairs import PairManager
from specdec_core.theory import PassCosts

from ..conftest import with_eos

ENTRY = Path(__file__).resolve().parents[2] / "app.py"  # the entry point (beside the app package)

SETTINGS = dict(k=4, max_new_tokens=12, drafter="model")


@pytest.fixture()
def zero_gpu(monkeypatch):
    """handlers imported again with a fake `spaces` package; the calls made inside GPU time are listed."""
    inside = []

    def GPU(fn=None, duration=60):
        def wrap(f):
            def on_gpu(*args, **kwargs):
                inside.append(f.__name__)
                return f(*args, **kwargs)
            return on_gpu
        return wrap(fn) if fn is not None else wrap

    monkeypatch.setitem(sys.modules, "spaces", types.SimpleNamespace(GPU=GPU))
    yield importlib.reload(handlers), inside
    monkeypatch.delitem(sys.modules, "spaces")
    importlib.reload(handlers)


def test_generation_runs_inside_the_gpu_calls(zero_gpu, tiny):
    module, inside = zero_gpu
    manager = PairManager()
    manager.pair = with_eos(tiny, [])
    views = list(module.race_stream(manager, None, "hello", SETTINGS))
    assert inside == ["_drive"] and views[-1].state.done
    out = list(module.api_generate(manager, None, "hello", SETTINGS))
    assert inside == ["_drive", "_rounds"] and out[-1]["identical"] is True and not out[0]["done"]


def test_without_spaces_nothing_is_wrapped(tiny):
    assert handlers.on_gpu(len) is len and "spaces" not in sys.modules


@pytest.mark.parametrize("env, graphs, probe", [({}, "auto", True), ({"SPACES_ZERO_GPU": "true"}, "off", False),
                                                ({"SPACES_ZERO_GPU": "true", "SPECDEC_GRAPHS": "inductor"}, "inductor", False)])
def test_zero_gpu_compiles_nothing_at_start_up(monkeypatch, env, graphs, probe):
    spec = importlib.util.spec_from_file_location("entry", ENTRY)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    for name in ("SPACES_ZERO_GPU", "SPECDEC_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = entry.options(["--pair", "Qwen/Qwen2.5-7B-Instruct,Qwen/Qwen2.5-0.5B-Instruct"])
    assert args.graphs == graphs and (not args.zero_gpu) == probe
    # in hosted mode the pair the Space starts with is served, other custom ids are not
    assert {"Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"} <= args.allowlist


def test_the_status_line_says_when_drafting_cannot_pay(tiny):
    # a draft as dear as the target, as the pair's costs would say (timed here, they would be at the machine's mercy)
    same = dataclasses.replace(tiny, draft=tiny.target, pass_costs=PassCosts({1: 1.0, 5: 1.3}, draft=1.0))
    said = PairManager.gpu_verdict(same)
    words, palavras = ("".join(t(key, lang, **values) for key, values in said) for lang in ("en", "pt"))
    assert "a draft step costs" in words and "gains little" in words
    assert "um passo do rascunho custa" in palavras and "ganha pouco" in palavras
    assert "a draft step costs 1.00 of a target step" in words
