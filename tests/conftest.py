import dataclasses
import os

import pytest
import torch

from specdec_core.models import make_pair
from specdec_core.models.tiny import tiny_models

CPU = torch.device("cpu")
# A tree's verification pass costs what a step does, so trees keep every node drafted: timed costs of
# the tiny sub-millisecond models would be noise, and their trees (and sampled outputs) would vary run to run.
FLAT_COSTS = {"pass_costs": {"sizes": {1: 1.0, 65: 1.0}, "draft": 0.0}}
os.environ["SPECDEC_CHECK_CACHE"] = "1"  # static caches check their device-side length every round too


@pytest.fixture(scope="session")
def tiny_set():
    """The tiny target with three drafts: itself, a perturbed copy, an unrelated random model."""
    target, perturbed, tok = tiny_models(seed=0)
    unrelated, _, _ = tiny_models(seed=123)
    return {
        "same": make_pair("same", target, target, tok, CPU, torch.float32, FLAT_COSTS),
        "perturbed": make_pair("perturbed", target, perturbed, tok, CPU, torch.float32, FLAT_COSTS),
        "unrelated": make_pair("unrelated", target, unrelated, tok, CPU, torch.float32, FLAT_COSTS),
    }


@pytest.fixture(scope="session")
def tiny(tiny_set):
    return tiny_set["perturbed"]


def with_eos(pair, eos_ids):
    return dataclasses.replace(pair, eos_ids=frozenset(eos_ids))
