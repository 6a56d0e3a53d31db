import math

import pytest
import torch

from specdec_core.sampling import warp


def logits_to_probs(logits, temperature, top_k=0, top_p=1.0):
    probs, failed = warp(logits, temperature, top_k, top_p)
    assert not failed
    return probs


def test_greedy_is_one_hot_at_argmax():
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_top_p_and_top_k_boundaries_with_exact_probabilities():
    """Four equal logits: probabilities of exactly 1/4. top_p = 0.5 is reached by two tokens, so the third one,
    whose mass before it is exactly 0.5, goes; top-k keeps nothing below the k-th logit, however close."""
    assert sorted(logits_to_probs(torch.zeros(4), 1.0, top_p=0.5).tolist()) == [0.0, 0.0, 0.5, 0.5]
    assert sorted(logits_to_probs(torch.zeros(4), 1.0, top_p=0.5000001).tolist())[1] > 0  # just past it: a third one
    probs = logits_to_probs(torch.tensor([2.0, 1.0, 0.995, 0.0]), 1.0, top_k=2)
    assert probs[2] == 0 and probs[3] == 0 and probs[:2].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("where, old, new", [
    ("top_p", "sorted_p) >= top_p", "sorted_p) > top_p"),
    ("top_k", "logits < kth,", "logits < kth - 0.01,"),
])
def test_moved_boundaries_are_caught(monkeypatch, where, old, new):
    from specdec_core import sampling

    from ..conftest import mutate

    mutate(monkeypatch, sampling, "warp", (old, new))
    monkeypatch.setitem(globals(), "warp", sampling.warp)
    with pytest.raises(AssertionError):
        test_top_p_and_top_k_boundaries_with_exact_probabilities()


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(logits_to_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]))
    # top_p=0.8: 0.5 + 0.3 reaches 0.8, so the third token is dropped
    assert torch.allclose(logits_to_probs(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    assert logits_to_probs(logits, 1.0, top_p=0.1).tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = logits_to_probs(logits, 0.5)
    assert hot[0] > 0.5 and math.isclose(hot.sum().item(), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_flagged(bad, temperature):
    assert warp(torch.tensor([[0.0, 1.0, 2.0], [5.0, bad, 0.0]]), temperature)[1]


def test_greedy_is_one_hot_at_the_first_maximum():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, float("-inf"), 0.0, 2.0]], dtype=torch.bfloat16)
    assert logits_to_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_minus_infinity_masks_a_token():
    assert logits_to_probs(torch.tensor([0.0, float("-inf")]), 1.0).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_warp_flags_a_failed_row_on_the_device_and_still_gives_distributions(temperature):
    probs, failed = warp(torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]]), temperature)
    assert failed.item() and torch.isfinite(probs).all()  # sampling from it cannot crash; the engine raises after
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert not warp(torch.tensor([[0.0, float("-inf"), 1.0]]), temperature)[1].item()
