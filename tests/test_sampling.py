import math

import pytest
import torch

from specdec_core.config import MAX_K, SpecConfig
from specdec_core.sampling import NonFiniteLogitsError, logits_to_probs


def test_greedy_is_one_hot_at_argmax():
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


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
def test_non_finite_logits_are_never_sampled(bad, temperature):
    with pytest.raises(NonFiniteLogitsError):
        logits_to_probs(torch.tensor([[0.0, 1.0, 2.0], [5.0, bad, 0.0]]), temperature)


def test_greedy_is_one_hot_at_the_first_maximum():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, float("-inf"), 0.0, 2.0]], dtype=torch.bfloat16)
    assert logits_to_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_minus_infinity_masks_a_token():
    assert logits_to_probs(torch.tensor([0.0, float("-inf")]), 1.0).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("kwargs", [dict(k=0), dict(k=-1), dict(k=MAX_K + 1), dict(max_new_tokens=0),
                                    dict(max_new_tokens=-5), dict(max_new_tokens=10**9), dict(temperature=-1),
                                    dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(seed=1.5),
                                    dict(seed="abc"), dict(k="4")])
def test_config_rejects_bad_values_with_a_message(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SpecConfig(**kwargs)


def test_config_normalises():
    assert SpecConfig(temperature=1e-9).greedy
    assert SpecConfig(seed=3.0).seed == 3


def test_theory_against_hand_computed_values():
    from specdec_core.theory import best_k, expected_speedup, expected_tokens_per_round, predicted_speedup
    assert expected_tokens_per_round(0.5, 1) == pytest.approx(1.5)  # 1 + 0.5
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens_per_round(1.0, 4) == 5 and expected_tokens_per_round(0.0, 4) == 1
    # a = 0.8, k = 4, c = 0.05: (1 - 0.8^5) / (0.2 * 1.2) = 0.67232 / 0.24
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(2.801333, rel=1e-5)
    assert expected_speedup(0.8, 4, 0.05, v=2.0) == pytest.approx(3.3616 / 2.2, rel=1e-5)
    assert best_k(0.9, 0.01) > best_k(0.5, 0.01) >= 1
    # drafts of varying length: mean tokens per round over mean cost per round
    assert predicted_speedup(0.8, [4, 4], 0.05, 1.2) == pytest.approx(expected_speedup(0.8, 4, 0.05, 1.2))
    assert predicted_speedup(0.5, [1, 3], 0.1, 1.0) == pytest.approx(((1.5 + 1.875) / 2) / (2 * 0.1 + 1.0))
