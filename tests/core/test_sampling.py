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


def test_a_failed_row_found_by_a_maximum_that_skips_nan_is_caught(monkeypatch):
    """Sampling finds a row's failure by its max alone (no argmax): one that passes NaN over misses the row."""
    from specdec_core import sampling

    from ..conftest import mutate

    mutate(monkeypatch, sampling, "warp", ("(logits.amax(", "(logits.nan_to_num(0.0, 0.0).amax("))
    monkeypatch.setitem(globals(), "warp", sampling.warp)
    with pytest.raises(AssertionError):
        test_non_finite_logits_are_flagged(float("nan"), 1.0)


def chains_child_is_ranked_at_the_largest_probability(children) -> bool:
    """sampling.children at width 1, greedy and sampled, on rows with masked and tied tokens: the child is the draft's
    argmax (greedy) or the draw `sample` makes from the same generator (sampled), ranked at its row's largest
    probability (q's, or greedy the draft's softmax), as topk gives it, to the bit."""
    from types import SimpleNamespace

    from specdec_core.sampling import sample

    logits = torch.tensor([[0.5, 2.0, float("-inf"), 2.0, -1.0], [3.0, 0.0, 0.25, float("-inf"), 1.0]])
    for greedy in (True, False):
        q = warp(logits, 0.0 if greedy else 0.7)[0]
        ranked = torch.softmax(logits, -1) if greedy else q
        top, picks = children(q, logits, 1, SimpleNamespace(greedy=greedy), torch.Generator().manual_seed(3))
        want = q.argmax(-1, keepdim=True) if greedy else sample(q, torch.Generator().manual_seed(3))[..., None]
        if not (torch.equal(top, torch.topk(ranked, 1, -1).values) and torch.equal(picks, want)):
            return False
    return True


def test_a_chains_child_is_ranked_at_its_rows_largest_probability():
    from specdec_core.sampling import children

    assert chains_child_is_ranked_at_the_largest_probability(children)


@pytest.mark.parametrize("old, new", [
    ("return ranked.amax(-1, keepdim=True), picks", "return ranked.amin(-1, keepdim=True), picks"),
    ("return ranked.amax(-1, keepdim=True), picks", "return q.amax(-1, keepdim=True), picks"),  # greedy: q is one-hot
])
def test_a_chains_child_ranked_wrongly_is_caught(monkeypatch, old, new):
    from specdec_core import sampling

    from ..conftest import mutate

    mutate(monkeypatch, sampling, "children", (old, new))
    assert not chains_child_is_ranked_at_the_largest_probability(sampling.children)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_warp_flags_a_failed_row_on_the_device_and_still_gives_distributions(temperature):
    probs, failed = warp(torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]]), temperature)
    assert failed.item() and torch.isfinite(probs).all()  # sampling from it cannot crash; the engine raises after
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert not warp(torch.tensor([[0.0, float("-inf"), 1.0]]), temperature)[1].item()


def sample_counts(draw, probs: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([draw(probs, g) for _ in range(n)])  # [n, rows]
    return torch.stack([torch.bincount(rows[:, r], minlength=probs.shape[-1]) for r in range(probs.shape[0])])


def sample_is_exact(draw) -> bool:
    """Rows of a large vocabulary (a zero-probability run at either end and in between, a row that is not normalised,
    a one-hot row): every draw has probability > 0, and the counts pass a chi-square test against each row."""
    from scipy.stats import chisquare

    v = 20_000
    probs = torch.zeros(3, v)
    probs[0, 1000:1006] = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.0, 0.3])
    probs[1, [0, 7, v - 1]] = torch.tensor([2.0, 1.0, 1.0])  # sums to 4: the residual's rows need not sum to 1
    probs[2, 12345] = 1.0
    counts = sample_counts(draw, probs, 2000)
    if (counts[probs == 0] > 0).any():
        return False
    for row, c in zip(probs, counts):
        keep = row > 0
        if keep.sum() > 1 and chisquare(c[keep].numpy(), (row[keep] / row.sum() * c.sum()).numpy()).pvalue < 1e-3:
            return False
    return True


def test_one_draw_per_row_follows_the_probabilities():
    """sampling.sample, which draws every sampled token (the draft's, the target's and the residual's): exact over a
    vocabulary's worth of tokens, never a token of probability 0."""
    from specdec_core.sampling import sample

    assert sample_is_exact(sample)


def invert_is_exact(invert) -> bool:
    """Where a uniform falls on an edge, exactly: token i holds [cdf(i - 1), cdf(i)) of the row's total, so a
    zero-probability token holds nothing, and the largest uniform (1 - 2^-53) picks the last token of probability > 0."""
    f64 = lambda *v: torch.tensor(v, dtype=torch.float64)
    probs = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.5])
    return (invert(probs, f64(0.0)).item() == 1 and invert(probs, f64(0.25)).item() == 3
            and invert(torch.tensor([1.0, 1.0, 1.0, 0.0]), f64(1 - 2 ** -53)).item() == 2)


def test_a_uniform_on_an_edge_picks_the_token_that_holds_it():
    from specdec_core.sampling import invert

    assert invert_is_exact(invert)


@pytest.mark.parametrize("old, new", [
    ("right=True", "right=False"),  # a uniform on an edge picks the zero-probability token before it
    ("u * cdf[..., -1:]", "u * cdf[..., -1:] * (1 + 2 ** -52)"),  # a uniform just under 1 goes past the last token
])
def test_a_wrong_edge_is_caught(monkeypatch, old, new):
    from specdec_core import sampling

    from ..conftest import mutate

    mutate(monkeypatch, sampling, "invert", (old, new))
    assert not invert_is_exact(sampling.invert)


def test_rows_taken_as_summing_to_one_are_caught(monkeypatch):
    from specdec_core import sampling

    from ..conftest import mutate

    mutate(monkeypatch, sampling, "invert", ("u * cdf[..., -1:]", "u"))
    monkeypatch.setattr(sampling, "invert", sampling.invert)
    assert not sample_is_exact(sampling.sample)
