"""SpecConfig: every setting validated in one place, with a message naming it."""
import pytest

from specdec_core.config import MAX_K, SpecConfig


@pytest.mark.parametrize("kwargs", [dict(k=0), dict(k=-1), dict(k=MAX_K + 1), dict(max_new_tokens=0),
                                    dict(max_new_tokens=-5), dict(max_new_tokens=10**9), dict(temperature=-1),
                                    dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(seed=1.5),
                                    dict(seed="abc"), dict(k="4"), dict(tree_nodes=-1), dict(tree_nodes=65),
                                    dict(tree_nodes=2.5), dict(guess=-1), dict(guess=4), dict(guess=1.5)])
def test_config_rejects_bad_values_with_a_message(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SpecConfig(**kwargs)


def test_config_normalises():
    assert SpecConfig(temperature=1e-9).greedy
    assert SpecConfig(seed=3.0).seed == 3
