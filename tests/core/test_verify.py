"""Exact checks of the accept/reject step on hand-built distributions (p = target, q = draft)."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_core.events import chain
from specdec_core.verify import accept_probabilities, decide, residual_distribution


def verify(draft_tokens, q, p, generator):
    """`decide`, read back: the accepted length and the token as ints, the residual when there was one."""
    d = decide(draft_tokens, chain(draft_tokens.numel()), q, p, generator)
    return SimpleNamespace(n_accepted=int(d.n_accepted), token=int(d.token), accept_probs=d.accept_probs,
                           uniforms=d.uniforms, residual=d.dist if bool(d.rejected) else None)


def one_hot(i, v=4):
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


def test_all_accepted_gives_bonus_from_last_target_row():
    p = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    q = torch.stack([one_hot(1), one_hot(2)])
    v = verify(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.token, v.residual) == (2, 3, None)
    assert v.accept_probs.tolist() == [1.0, 1.0]


def test_first_rejected_samples_target_replacement():
    p = torch.stack([one_hot(0), one_hot(2), one_hot(3)])
    q = torch.stack([one_hot(1), one_hot(2)])
    v = verify(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.token) == (0, 0)
    assert v.accept_probs.tolist() == [0.0, 1.0]
    assert v.residual.tolist() == one_hot(0).tolist()


def test_the_residual_after_a_later_rejection_takes_that_rows_q():
    """Accept the first token surely, reject the second surely: the residual is norm(max(0, p_1 - q_1)), with
    row 1's q; row 0's q would give another distribution."""
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.25, 0.25], [0.25] * 4])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25, 0.5, 0.25, 0.0]])
    for seed in range(5):
        v = verify(torch.tensor([1, 1]), q, p, torch.Generator().manual_seed(seed))
        assert v.n_accepted == 1 and v.residual.tolist() == [0.5, 0.0, 0.0, 0.5] and v.token in (0, 3)


def test_a_residual_from_the_previous_rows_q_is_caught(monkeypatch):
    from specdec_core import verify as module

    from ..conftest import mutate

    mutate(monkeypatch, module, "_decide_chain", ("q.index_select(0, at.clamp(max=k - 1))",
                                                   "q.index_select(0, (at - 1).clamp(min=0, max=k - 1))"))
    with pytest.raises(AssertionError):
        test_the_residual_after_a_later_rejection_takes_that_rows_q()


def test_middle_rejected():
    p = torch.stack([one_hot(1), one_hot(1), one_hot(3), one_hot(0)])
    q = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    v = verify(torch.tensor([1, 2, 3]), q, p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.token) == (1, 1)


def test_k1_and_k0():
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    v = verify(torch.tensor([1]), torch.tensor([[0.1, 0.9, 0.0, 0.0]]), p, torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.token) == (1, 3)
    v = verify(torch.tensor([], dtype=torch.long), None, p[:1], torch.Generator().manual_seed(0))
    assert (v.n_accepted, v.token) == (0, 1)


def test_partial_acceptance_uses_ratio_and_uniform():
    p = torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    outcomes = set()
    for seed in range(40):  # both outcomes of the draw, each checked
        v = verify(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert v.accept_probs.tolist() == [0.5]
        assert v.n_accepted == int(v.uniforms[0] < 0.5)
        if v.n_accepted == 0:  # residual max(0, p - q) = [0, .25, 0] -> token 1
            assert v.token == 1 and v.residual.tolist() == [0.0, 1.0, 0.0]
        else:
            assert v.token == 0 and v.residual is None  # the bonus, from p's next row
        outcomes.add(v.n_accepted)
    assert outcomes == {0, 1}


def test_deterministic_drafter_is_point_mass():
    p = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    outcomes = set()
    for seed in range(40):
        v = verify(torch.tensor([1]), None, p, torch.Generator().manual_seed(seed))
        assert abs(v.accept_probs[0].item() - 0.4) < 1e-7
        if v.n_accepted == 0:
            assert v.token == 0  # residual = p without the rejected token
        outcomes.add(v.n_accepted)
    assert outcomes == {0, 1}


def output_distribution(p, q):
    """P(first output token = y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y), with a, r the functions under test."""
    a = accept_probabilities(p, q)
    return q * a + (1 - (q * a).sum()) * residual_distribution(p, q)


def test_first_token_has_exactly_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    cases = []
    for v in (2, 5, 50):
        for _ in range(50):
            p = torch.rand(v, generator=g, dtype=torch.float64) ** 3
            q = torch.rand(v, generator=g, dtype=torch.float64) ** 3
            p[torch.rand(v, generator=g) < 0.3] = 0  # sparse supports
            p[0] += 1e-3
            q[-1] += 1e-3
            cases.append((p / p.sum(), q / q.sum()))
    d = torch.tensor([0.7, 0.3, 0.0, 0.0], dtype=torch.float64)
    cases += [(d, d.clone()),  # identical
              (d, torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64)),  # disjoint support
              (torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), d),  # one-hot target
              (d, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64))]  # one-hot draft
    for p, q in cases:
        assert torch.allclose(output_distribution(p, q), p, atol=1e-6), (p, q)


@st.composite
def verify_inputs(draw):
    v = draw(st.integers(2, 8))
    k = draw(st.integers(0, 5))
    weights = st.lists(st.floats(0, 1), min_size=v, max_size=v).filter(lambda w: sum(w) > 1e-3)
    p = torch.tensor([draw(weights) for _ in range(k + 1)])
    q = torch.tensor([draw(weights) for _ in range(k)]).reshape(k, v)
    tokens = torch.tensor(draw(st.lists(st.integers(0, v - 1), min_size=k, max_size=k)), dtype=torch.long)
    return tokens, q / q.sum(-1, keepdim=True) if k else q, p / p.sum(-1, keepdim=True), draw(st.integers(0, 2**31))


@settings(max_examples=300, deadline=None)
@given(verify_inputs(), st.booleans())
def test_fuzz_never_crashes_or_leaves_the_support(inputs, deterministic):
    tokens, q, p, seed = inputs
    v = verify(tokens, None if deterministic else q, p, torch.Generator().manual_seed(seed))
    assert 0 <= v.n_accepted <= tokens.numel()
    assert 0 <= v.token < p.shape[-1]
    assert p[v.n_accepted, v.token] > 0  # the target's token is always possible under p
    for i in range(v.n_accepted):
        assert p[i, tokens[i]] > 0


@settings(max_examples=200, deadline=None)
@given(verify_inputs())
def test_fuzz_draft_equal_to_target_accepts_everything(inputs):
    _, _, p, seed = inputs
    g = torch.Generator().manual_seed(seed)
    k = p.shape[0] - 1
    tokens = torch.multinomial(p[:k], 1, generator=g).view(-1) if k else torch.empty(0, dtype=torch.long)
    v = verify(tokens, p[:k], p, g)
    assert v.n_accepted == k and v.residual is None


@pytest.mark.parametrize("parents", [[-1, 0], [-1, -1]], ids=["chain", "siblings"])
def test_a_node_is_accepted_exactly_when_its_uniform_is_below_its_ratio(parents, monkeypatch):
    """u < min(1, p/q), strictly: the uniform equal to the ratio, or a hair above it, rejects; a hair below accepts.
    Random uniforms land on that edge too rarely for any distribution test to see a loosened comparison."""
    p = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]] if parents == [-1, -1] else [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    x = torch.tensor([0, 1] if parents == [-1, -1] else [0, 0])
    a = accept_probabilities(p[0, 0:1], q[0, 0:1])[0]  # the first node's ratio, as decide computes it: 0.5
    rand = torch.rand
    for u, accepted in ((torch.nextafter(a, torch.tensor(0.0)), True), (a, False), (a * 1.0005, False)):
        uniforms = torch.stack([u, torch.tensor(1.0)])  # the second node always rejected
        monkeypatch.setattr(torch, "rand", lambda *n, generator=None, device=None, dtype=None:
                            uniforms.clone() if dtype is None else rand(*n, generator=generator, dtype=dtype))
        d = decide(x, parents, q, p, torch.Generator().manual_seed(0))
        assert bool(d.on_path[0]) is accepted, (float(u), float(a))


@pytest.mark.parametrize("parents", [[-1, 0], [-1, -1]], ids=["chain", "siblings"])
def test_a_loosened_comparison_is_caught(parents, monkeypatch):
    from specdec_core import verify as module

    from ..conftest import mutate

    mutate(monkeypatch, module, "_decide_chain", ("uniforms < accept", "uniforms <= accept * 1.001"))
    mutate(monkeypatch, module, "_decide_tree", ("uniforms[c] < accept[c]", "uniforms[c] <= accept[c] * 1.001"))
    with pytest.raises(AssertionError):
        test_a_node_is_accepted_exactly_when_its_uniform_is_below_its_ratio(parents, monkeypatch)
