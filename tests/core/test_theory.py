"""The cost model (Leviathan et al.) against values computed by hand."""
import pytest

from specdec_core.theory import expected_speedup, expected_tokens_per_round, predicted_speedup


def test_theory_against_hand_computed_values():
    assert expected_tokens_per_round(0.5, 1) == pytest.approx(1.5)  # 1 + 0.5
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens_per_round(1.0, 4) == 5 and expected_tokens_per_round(0.0, 4) == 1
    # a = 0.8, k = 4, c = 0.05: (1 - 0.8^5) / (0.2 * 1.2) = 0.67232 / 0.24
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(2.801333, rel=1e-5)
    assert expected_speedup(0.8, 4, 0.05, v=2.0) == pytest.approx(3.3616 / 2.2, rel=1e-5)
    # drafts of varying length: mean tokens per round over mean cost per round
    assert predicted_speedup(0.8, [4, 4], 0.05, 1.2) == pytest.approx(expected_speedup(0.8, 4, 0.05, 1.2))
    assert predicted_speedup(0.5, [1, 3], 0.1, 1.0) == pytest.approx(((1.5 + 1.875) / 2) / (2 * 0.1 + 1.0))
