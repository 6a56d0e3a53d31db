import dataclasses
import inspect
import sys
import textwrap

import pytest
import torch

from specdec_core.cache import CachedModel
from specdec_core.models import make_pair
from specdec_core.models.tiny import NOMINAL_COSTS, tiny_models

CPU = torch.device("cpu")
# A tree's verification pass costs what a step does, so trees keep every node drafted: timed costs of
# the tiny sub-millisecond models would be noise, and their trees (and sampled outputs) would vary run to run.
PRODUCTION_CHECK = CachedModel.check


def full_check(lm: CachedModel) -> None:
    """Every round, the static caches' length too: it is kept on the device, and a GPU round does not read it."""
    PRODUCTION_CHECK(lm)
    assert int(lm.cache.get_seq_length()) == lm.length, (lm.cache.get_seq_length(), lm.length)


@pytest.fixture(autouse=True)
def checked_caches(monkeypatch):
    monkeypatch.setattr(CachedModel, "check", full_check)


@pytest.fixture
def uncompiled(monkeypatch):
    """The compiled path (static caches, padded inputs, the fallback) with the model's own forward as its compiled
    step: what it runs is this project's, not dynamo's tracing, which the slow tier compiles for real (seconds)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)


@pytest.fixture(scope="session")
def tiny_set():
    """The tiny target with three drafts: itself, a perturbed copy, an unrelated random model."""
    target, perturbed, tok = tiny_models(seed=0)
    unrelated, _, _ = tiny_models(seed=123)
    return {
        name: dataclasses.replace(make_pair(name, target, draft, tok, CPU, torch.float32), pass_costs=NOMINAL_COSTS)
        for name, draft in (("same", target), ("perturbed", perturbed), ("unrelated", unrelated))
    }


@pytest.fixture(scope="session")
def tiny(tiny_set):
    return tiny_set["perturbed"]


def with_eos(pair, eos_ids):
    return dataclasses.replace(pair, eos_ids=frozenset(eos_ids))


def mutate(monkeypatch, owner, name: str, *edits: tuple[str, str]) -> None:
    """Plant a bug: `owner.name` (a module's function or a class's method) rebuilt from its source with each
    (old, new) edit made, where `old` occurs exactly once. Modules that imported the function by name get it too."""
    function = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(function))
    for old, new in edits:
        assert source.count(old) == 1, f"the mutant's anchor {old!r} is not in {name} exactly once"
        source = source.replace(old, new)
    scope = {}
    exec(compile(source, f"<mutant of {name}>", "exec"), function.__globals__, scope)
    monkeypatch.setattr(owner, name, scope[name])
    for module in [m for key, m in sys.modules.items() if key.startswith("specdec_core")]:
        if getattr(module, name, None) is function:
            monkeypatch.setattr(module, name, scope[name])
