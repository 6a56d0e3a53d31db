"""Token trees: the one-pass tree verification, the cache kept on the accepted path, and lossless output."""
import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from specdec_core import SpecConfig, generate, speculative_generate, theory, verify
from specdec_core.cache import TreeInput
from specdec_core.drafters import ModelDrafter
from specdec_core.events import tree_depths
from specdec_core.models import pair as pair_module
from specdec_core.policy import Policy
from specdec_core.sampling import without
from specdec_core.theory import PassCosts, tree_size
from specdec_core.timing import TREE_PASS_SIZES
from specdec_core.trees import GrowingDraft
from specdec_core.verify import decide

from ..conftest import mutate, with_eos

PROMPT = "def fib(n):"


def test_the_chain_path_decides_a_chain_exactly_as_the_tree_path():
    torch.manual_seed(0)
    for seed in range(100):
        p, q = torch.softmax(torch.randn(5, 6) * 2, -1), torch.softmax(torch.randn(4, 6) * 2, -1)
        x = torch.multinomial(q, 1)[:, 0]
        a = decide(x, [-1, 0, 1, 2], q, p, torch.Generator().manual_seed(seed))  # a chain: the vectorised path
        b = verify._decide_tree(x, [-1, 0, 1, 2], q, p, torch.Generator().manual_seed(seed))
        assert (int(a.n_accepted), int(a.token), bool(a.rejected)) == (int(b.n_accepted), int(b.token), bool(b.rejected))
        assert torch.equal(a.accept_probs, b.accept_probs) and torch.equal(a.on_path, b.on_path)
        assert torch.equal(a.p_x, b.p_x) and torch.equal(a.dist, b.dist)


def emitted(p, q, first, second, u, monkeypatch):
    """decide at a root with two children (x1, then x2 drawn without replacement), with chosen uniforms."""
    q1, q2 = q, without(q, [first])
    rand = torch.rand  # the verdicts' uniforms chosen; the emitted token's draw (float64) a real one
    monkeypatch.setattr(torch, "rand", lambda *n, generator=None, device=None, dtype=None:
                        torch.tensor(u) if dtype is None else rand(*n, generator=generator, dtype=dtype))
    return decide(torch.tensor([first, second]), [-1, -1], torch.stack([q1, q2]), torch.stack([p, p, p]))


@pytest.mark.parametrize("seed", range(5))
def test_two_candidates_emit_exactly_p(seed, monkeypatch):
    """Summed over every ordered draw (x1, x2) and the accept/reject outcomes, the first token is p, exactly."""
    g = torch.Generator().manual_seed(seed)
    p, q = (torch.softmax(torch.randn(5, generator=g, dtype=torch.float64) * 2, -1) for _ in range(2))
    total = torch.zeros(5, dtype=torch.float64)
    for x1 in range(5):
        for x2 in range(5):
            if x2 == x1:
                continue
            weight = q[x1] * without(q, [x1])[x2]
            rejected_both = emitted(p, q, x1, x2, [1.0, 1.0], monkeypatch)  # u = 1 rejects whatever a is
            a1, a2 = rejected_both.accept_probs.tolist()
            out = torch.zeros(5, dtype=torch.float64)
            out[x1] += a1
            out[x2] += (1 - a1) * a2
            out += (1 - a1) * (1 - a2) * rejected_both.dist
            total += weight * out
    assert torch.allclose(total, p, atol=1e-12)


def test_greedy_tree_takes_the_branch_the_target_agrees_with():
    one = lambda i: torch.nn.functional.one_hot(torch.tensor(i), 6).float()
    # root children 1 (wrong), 2 (right); node 2's children 3 (right), 4; the target then wants 5
    tokens, parents = torch.tensor([1, 2, 3, 4]), [-1, -1, 1, 1]
    p = torch.stack([one(2), one(0), one(3), one(5), one(0)])
    d = decide(tokens, parents, None, p)
    assert d.on_path.tolist() == [False, True, True, False] and int(d.token) == 5 and not bool(d.rejected)


def test_tree_forward_then_compact_leaves_the_cache_a_plain_pass_would(tiny):
    lm = tiny.cached("target")
    prefix = [5, 6, 7, 8]
    lm.prefill(prefix)
    # root 9 with children 10 and 11; 11 has child 12: keep the path 9 -> 11 -> 12
    tree_logits = lm.forward(torch.tensor([9, 10, 11, 12]), keep=4, tree=TreeInput([-1, 0, 0, 2]))
    lm.compact(len(prefix) + 1, [1, 2])
    lm.check()
    plain = tiny.cached("target")
    plain.prefill(prefix)
    chain_logits = plain.forward(torch.tensor([9, 11, 12]), keep=3)
    assert torch.allclose(tree_logits[[0, 2, 3]], chain_logits, atol=1e-5)
    nxt = torch.tensor([13])
    assert torch.allclose(lm.forward(nxt, keep=1), plain.forward(nxt, keep=1), atol=1e-5)


@pytest.mark.parametrize("width, expand", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3)])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_tree_equals_autoregressive(tiny_set, width, expand, k):
    for draft in ("perturbed", "unrelated"):
        pair = with_eos(tiny_set[draft], [])
        for n, nodes in ((1, 4), (7, 1), (40, 6), (40, 24)):
            cfg = SpecConfig(k=k, max_new_tokens=n, tree_nodes=nodes)
            ar = generate(pair, PROMPT, cfg, "autoregressive")
            spec = generate(pair, PROMPT, cfg, drafter=ModelDrafter(pair.cached("draft"), width=width, expand=expand))
            assert spec.token_ids == ar.token_ids and len(spec.token_ids) == n, (draft, width, k, n, nodes)


def test_a_tree_accepts_more_per_pass_than_a_chain(tiny_set):
    pair = with_eos(tiny_set["perturbed"], [])
    chain = generate(pair, PROMPT, SpecConfig(k=4, max_new_tokens=64))
    tree = generate(pair, PROMPT, SpecConfig(k=4, max_new_tokens=64, tree_nodes=24))
    assert tree.token_ids == chain.token_ids
    assert tree.stats.mean_accepted_length > chain.stats.mean_accepted_length


def test_eos_inside_a_branch_ends_generation_there(tiny_set):
    pair = with_eos(tiny_set["perturbed"], [])
    cfg = SpecConfig(k=4, max_new_tokens=24, tree_nodes=12)
    reference = generate(pair, PROMPT, cfg, "autoregressive").token_ids
    for eos in dict.fromkeys(reference):
        out = generate(with_eos(pair, [eos]), PROMPT, cfg)
        assert out.token_ids == reference[: reference.index(eos) + 1] and out.stats.finish_reason == "eos"


def test_tree_events_describe_each_round(tiny):
    drafter = ModelDrafter(tiny.cached("draft"))
    cfg = SpecConfig(k=4, max_new_tokens=40, temperature=1.0, tree_nodes=10, record_top=3, seed=3)
    events = list(speculative_generate(with_eos(tiny, []), PROMPT, cfg, drafter))
    assert any(len(e.path) > 0 for e in events) and any(len(set(e.parents)) < len(e.parents) for e in events)
    for e in events:
        n = len(e.drafted)
        assert n or e.n_generated == cfg.max_new_tokens  # only a round with room for one token left drafts nothing
        assert len(e.parents) == n <= 10 and all(-1 <= parent < i for i, parent in enumerate(e.parents))
        assert len(e.target_top) == n + 1 and len(e.draft_top) == n and len(e.accept_probs) == n
        path = e.path
        assert [e.parents[i] for i in path] == ([-1] + path)[: len(path)]  # root to leaf, each node the last one's child
        assert e.committed == ([e.drafted[i] for i in path] + [e.token])[: len(e.committed)]
        assert e.accepted == len(path) and (e.expected > 0) == (n > 0)  # a round that drafts nothing expects nothing
        assert (e.residual_top is None) == (e.token_kind == "bonus")
        assert e.token_kind == ("bonus" if not any(parent == (path[-1] if path else -1) for parent in e.parents)
                                else "replacement")
    a = [e.committed for e in events]
    b = [e.committed for e in speculative_generate(with_eos(tiny, []), PROMPT, cfg)]
    assert a == b  # same seed, same tree, same output


def test_tree_size_follows_the_cost_of_a_pass():
    ranked = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01]
    assert tree_size(ranked, None) == 8
    flat = PassCosts({1: 1.0, 16: 1.0})
    assert tree_size(ranked, flat) == 8  # rows cost nothing: take every node that may be accepted
    # a pass of n tokens costs 1 + (n - 1) / 4, a draft forward 0.5: n nodes are worth (1 + their ranks) / (1.5 + n / 4),
    # for n = 0..4: 0.667, 1.086, 1.350, 1.422, 1.400
    linear = PassCosts({1: 1.0, 65: 17.0}, draft=0.5)
    assert tree_size(ranked, linear) == 3
    assert linear.verify(9) == pytest.approx(3.0)
    # timed: a pass of 2 dearer than its neighbours. The model is the lower convex hull, 1 + 8 (n - 1) / 15 up to 16,
    # so n = 0..3 are worth 0.667, 0.934, 1.052, 1.032: 2 nodes. (The best over every count, on the timings as they
    # are, is 3, a count that only the nodes after the first two make worth it.)
    uneven = PassCosts({1: 1.0, 2: 2.5, 4: 2.6, 16: 9.0}, draft=0.5)
    assert [round(uneven.verify(n), 3) for n in (2, 4)] == [1.533, 2.6]
    assert tree_size(ranked, uneven) == 2


def test_a_nodes_place_in_the_tree_never_depends_on_the_ranks_after_it():
    """Exactness needs it (verify.py): a tree cut at n nodes stays cut there whatever follows, even a rank that
    would pay for the one before it. Each count is checked against lists that go on with a high and a low rank."""
    costs = (PassCosts({1: 1.0, 65: 17.0}, draft=0.5), PassCosts({1: 1.0, 2: 2.5, 4: 2.6, 16: 9.0}, draft=0.5))
    rng = torch.Generator().manual_seed(0)
    cut = 0
    for _ in range(300):
        ranked = torch.rand(int(torch.randint(1, 9, (1,), generator=rng)), generator=rng).tolist()
        for c in costs:
            n = theory.tree_size(ranked, c)
            if n < len(ranked):
                cut += 1
                assert [theory.tree_size(ranked + [x], c) for x in (1.0, 0.0)] == [n, n], (ranked, n)
    assert cut > 100  # most lists were cut, so the rule was put to the test


def test_tree_sizing_that_looks_one_rank_ahead_is_caught(monkeypatch):
    ahead = ("        if (tokens + rank)", "        after = ranked[n + 1] if n + 1 < len(ranked) else 0.0\n"
             "        if (tokens + rank + after) / (fixed + costs.verify(n + 3)) < tokens / (fixed + costs.verify(n + 1)) "
             "and (tokens + rank)")
    mutate(monkeypatch, theory, "tree_size", ahead)
    with pytest.raises(AssertionError):
        test_a_nodes_place_in_the_tree_never_depends_on_the_ranks_after_it()


def test_tree_costs_are_timed_once_per_pair(tiny, monkeypatch):
    pair = dataclasses.replace(tiny, pass_costs=None)
    costs = pair.costs()
    assert sorted(costs.sizes) == list(TREE_PASS_SIZES) and costs.sizes[1] == 1.0
    assert all(c > 0 for c in costs.sizes.values()) and costs.draft > 0
    monkeypatch.setattr(pair_module, "tree_costs", lambda pair: pytest.fail("timed again"))
    assert pair.costs() is costs  # kept with the pair, not timed again
    assert dataclasses.replace(pair).timed == {}  # another pair (its models may be others) times its own


@pytest.mark.parametrize("min_confidence", [0.0, 0.35])
def test_a_tree_holds_the_chain_the_chain_drafter_drafts(tiny, min_confidence):
    ids = tiny.tokenizer.encode("def fib(n): return")
    cfg = SpecConfig(k=8, min_confidence=min_confidence)
    chain, tree = ModelDrafter(tiny.cached("draft")), ModelDrafter(tiny.cached("draft"))
    list(chain.start(ids))  # the prefill runs as it is iterated
    list(tree.start(ids))  # the prefill runs as it is iterated
    expected = chain.propose(ids, 8, cfg, None).tokens.tolist()
    drafted = tree.propose(ids, 8, dataclasses.replace(cfg, tree_nodes=24), None)
    first_children, at = [], -1
    while kids := [i for i, parent in enumerate(drafted.parents) if parent == at]:
        at = kids[0]
        first_children.append(int(drafted.tokens[at]))
    assert first_children == expected and len(drafted) > len(expected)


def test_the_draft_keeps_every_accepted_node_it_fed(tiny_set):
    """With the draft equal to the target every chain node is accepted; of a path of depth k, the draft fed
    all but the last, so when the next round settles its cache holds all of the sequence but the last two tokens
    (counted without guesses, which would ride on the same forwards)."""
    pair = with_eos(tiny_set["same"], [])
    cfg = SpecConfig(k=6, max_new_tokens=60, tree_nodes=12, guess=0)
    drafter = ModelDrafter(pair.cached("draft"))
    forward, fed, settle, behind = drafter.lm.forward, [], drafter.settle, []

    def settled(ids):
        settle(ids)
        behind.append(len(ids) - drafter.lm.length)

    def counting(ids, *args, **kwargs):
        if not kwargs.get("prompt") and kwargs.get("tree") is None:  # a round's catch-up, not the prompt or a level
            fed.append(ids.numel())
        return forward(ids, *args, **kwargs)

    drafter.lm.forward, drafter.settle = counting, settled
    events = list(speculative_generate(pair, PROMPT, cfg, drafter))
    assert all(e.accepted == e.depth for e in events)  # the whole chain accepted
    assert behind == [1] + [2] * (len(events) - 1)  # after the prompt, its last token alone unfed
    assert fed and max(fed) <= 2  # each round feeds the draft only the two tokens it has not seen


class MarkovLM:
    """A CachedModel stand-in whose next-token distribution depends on the last token only: probs[last]."""

    device = torch.device("cpu")

    def __init__(self, probs: torch.Tensor):
        self.logits, self.length, self.vocab = probs.log(), 0, probs.shape[-1]

    def reset(self):
        self.length = 0

    def prefill_chunks(self, ids):
        self.length = len(ids)
        yield self.length

    def forward(self, ids, keep, step=True, tree=None):
        self.length += ids.numel()
        return self.logits[ids.view(-1)[-keep:]]

    def compact(self, start, kept):
        self.length = start + len(kept)

    def crop(self, length):
        self.length = min(self.length, length)

    def check(self):
        pass


# After token 0 the draft is sure of the next token; after 1 or 2 it is not. So how deep a chain goes (the draft
# forwards a round takes) depends on the chain's first token, and with these costs a node's value depends on it too.
MARKOV = torch.tensor([[0.9, 0.05, 0.05], [0.4, 0.3, 0.3], [0.4, 0.3, 0.3]], dtype=torch.float64)
STEEP = PassCosts({1: 1.0, 2: 1.6, 4: 2.4, 8: 4.0, 16: 8.0, 65: 33.0}, draft=0.2)  # not convex: 2 -> 4 is cheap


def first_tokens(drafter, samples: int, target: torch.Tensor = MARKOV,
                 cfg: SpecConfig = SpecConfig(k=4, temperature=1.0, min_confidence=0.35, tree_nodes=16)):
    """The first token each of `samples` tree rounds emits after token 2, `target` the target's Markov table (by
    default the draft's own: p = q), and each round's tree as drafted: (tokens, depths, sizes)."""
    ids, out, depths, sizes = [2], [], [], []
    for seed in range(samples):
        g = torch.Generator().manual_seed(seed)
        list(drafter.start(ids))  # the prefill runs as it is iterated
        d = drafter.propose(ids, cfg.k, cfg, g)
        p = target[ids[-1:] + d.tokens.tolist()].float()
        verdict = decide(d.tokens, d.parents, d.q, p, g) if len(d) else None  # none: a plain step
        path = verdict.on_path.nonzero().view(-1).tolist() if verdict is not None else []
        out.append(int(d.tokens[path[0]]) if path else int(verdict.token) if verdict is not None
                   else int(torch.multinomial(p[0], 1, generator=g)))
        depths.append(max(tree_depths(d.parents), default=0) if len(d) else 0)
        sizes.append(len(d))
    return out, depths, sizes


def grown_by_confidence(monkeypatch):
    """Trees sized by tree_size alone: every round drafts, the confidence cut alone sets the depth (the policy's own
    stop held open), so the draft forwards vary with this round's draws, and each node is worth its rank."""
    monkeypatch.setattr(Policy, "plan", lambda policy, k, reads=True: (k, [], 0.0))
    monkeypatch.setattr(Policy, "go_on", lambda policy, worths, rate, guessed=False: True)
    monkeypatch.setattr(Policy, "worth", lambda policy, prob: prob)


def test_trees_sized_by_a_steep_uneven_cost_emit_exactly_p(monkeypatch):
    """Whether a node is kept must not depend on the token drawn there (or below it): else the kept nodes are a
    biased sample. Here the draft's confidence after a token depends on the token, and the costs reward deep chains."""
    grown_by_confidence(monkeypatch)
    samples = 3000
    drafted, depths, _ = first_tokens(ModelDrafter(MarkovLM(MARKOV), pass_cost=STEEP), samples)
    assert len(set(depths)) > 1  # chains of both depths were drafted, and the costs made the deeper one pay
    observed = [drafted.count(t) for t in range(3)]
    p = MARKOV[2]
    assert chisquare(observed, (p * samples).tolist()).pvalue > 1e-3, observed


def test_trees_sized_by_looking_ahead_are_detected(monkeypatch):
    """The sizing rule before this one, planted back: the best count over every prefix of the ranked nodes, with
    the draft forwards of the round itself, on the timings as they are. The test above must catch it."""
    monkeypatch.setattr(PassCosts, "hull", property(lambda costs: sorted(costs.sizes.items())))
    own = "    self.forwards = forwards  # this round's own\n    draft = self.select("
    mutate(monkeypatch, ModelDrafter, "grow", ("    draft = self.select(", own))
    mutate(monkeypatch, theory, "tree_size", ("    fixed, tokens", "    return max(range(len(ranked) + 1), key=lambda n: "
                                                 "(1 + sum(ranked[:n])) / (forwards * costs.draft + costs.verify(n + 1)))\n"
                                                 "    fixed, tokens"))
    with pytest.raises(AssertionError, match="assert np.float64"):
        test_trees_sized_by_a_steep_uneven_cost_emit_exactly_p(monkeypatch)


# a draft that prefers what the target least wants: later siblings are judged against residuals far from p
AVERSE_Q = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4, dtype=torch.float64)
AVERSE_P = torch.tensor([[0.05, 0.15, 0.3, 0.5]] * 4, dtype=torch.float64)


def test_three_sampled_siblings_of_a_draft_unlike_the_target_emit_exactly_p():
    """Each sibling's q is its parent's without the siblings drawn before it, renormalised: with p = q (the test
    above) a later sibling is never judged, so this one takes a draft unlike the target and three siblings."""
    samples = 4000
    out, depths, sizes = first_tokens(ModelDrafter(MarkovLM(AVERSE_Q), width=3), samples, AVERSE_P,
                                      SpecConfig(k=1, temperature=1.0, tree_nodes=3, min_confidence=0.0))
    assert set(sizes) == {3} and set(depths) == {1}  # three siblings of the root
    observed = [out.count(t) for t in range(4)]
    assert chisquare(observed, (AVERSE_P[2] * samples).tolist()).pvalue > 1e-3, observed


@pytest.mark.parametrize("earlier", ["m.sibling < node.sibling - 1]", "m.sibling <= node.sibling]"])
def test_a_sibling_that_removes_one_sibling_too_few_or_too_many_is_caught(earlier, monkeypatch):
    mutate(monkeypatch, ModelDrafter, "select", ("m.sibling < node.sibling]", earlier))
    with pytest.raises(AssertionError, match="assert np.float64"):
        test_three_sampled_siblings_of_a_draft_unlike_the_target_emit_exactly_p()


# passes of 1.2 steps a token and a draft forward of a step: whether the chain's first node pays (its rank is the
# root's largest probability, 0.4) turns on whether the round takes two draft forwards or three, and so (MARKOV) on
# the token drawn there
COSTLY = PassCosts({1: 1.0, 2: 2.4, 4: 4.8, 8: 9.6, 16: 19.2, 65: 78.0}, draft=1.0)
TARGET = torch.tensor([[0.2, 0.4, 0.4]] * 3, dtype=torch.float64)  # unlike the draft: a node kept or not matters


def test_trees_sized_by_the_last_rounds_forwards_emit_exactly_p(monkeypatch):
    """A tree's size may use the draft forwards the previous round took, never this round's: those follow the
    tokens this round drew, and a node kept only when its own token made the chain deep is a biased sample."""
    grown_by_confidence(monkeypatch)
    samples = 3000
    out, _, sizes = first_tokens(ModelDrafter(MarkovLM(MARKOV), pass_cost=COSTLY), samples, TARGET)
    assert 0 in sizes and len(set(sizes)) > 1  # the first node's worth was in question
    observed = [out.count(t) for t in range(3)]
    assert chisquare(observed, (TARGET[2] * samples).tolist()).pvalue > 1e-3, observed


def test_trees_sized_by_this_rounds_own_forwards_are_caught(monkeypatch):
    own = "    self.forwards = forwards  # this round's own\n    draft = self.select("
    mutate(monkeypatch, ModelDrafter, "grow", ("    draft = self.select(", own))
    with pytest.raises(AssertionError, match="assert np.float64"):
        test_trees_sized_by_the_last_rounds_forwards_emit_exactly_p(monkeypatch)


# a draft forward 0.3 of a step, 0.2 a row: drafting pays before the round (the prior's forecast), and a chain's
# second token does not once its first is drawn at 0.4
LEAN = PassCosts({1: 1.0, 2: 1.2, 65: 13.8}, draft=0.3)
CHAIN = SpecConfig(k=4, temperature=1.0)


def test_chains_the_policy_plans_and_stops_emit_exactly_p():
    """The policy drafts (its plan, before the round) and stops the chain after its first token (its rule, within
    it): what it drafts follows the draft's own draws alone, and a draft unlike the target emits exactly p."""
    samples = 3000
    out, depths, _ = first_tokens(ModelDrafter(MarkovLM(MARKOV), pass_cost=LEAN), samples, TARGET, CHAIN)
    assert max(depths) == 1  # every chain drafted and stopped after its first token
    observed = [out.count(t) for t in range(3)]
    assert chisquare(observed, (TARGET[2] * samples).tolist()).pvalue > 1e-3, observed


def test_a_policy_that_drops_a_token_by_its_own_draw_is_caught(monkeypatch):
    """Planted: where the chain stops, its last token is dropped when its own draw was unlikely under the draft (a
    rule that peeks at what this round drew, to keep it or not)."""
    mutate(monkeypatch, ModelDrafter, "grow", ("            break\n", "            if g.qs[-1][g.nodes[-1].token] < 0.35:\n"
                                               "                g.nodes.pop()\n            break\n"))
    with pytest.raises(AssertionError, match="assert np.float64"):
        test_chains_the_policy_plans_and_stops_emit_exactly_p()


# rows cheap to three, dear after: of the root's four children (draft probabilities 0.5, 0.3, 0.15, 0.05), the two
# first are worth their rows at the policy's prior, the others not
BENT = PassCosts({1: 1.0, 2: 1.1, 3: 1.35, 4: 1.6, 65: 30.0}, draft=0.1)


def test_trees_the_policy_sizes_by_calibrated_worths_emit_exactly_p():
    """A tree's nodes kept by their worths: each probability on a node's path is its parent's j-th largest, calibrated
    by the policy, never the drawn token's own; three siblings of a draft unlike the target emit exactly p."""
    samples = 3000
    cfg = SpecConfig(k=1, temperature=1.0, tree_nodes=4)
    out, _, sizes = first_tokens(ModelDrafter(MarkovLM(AVERSE_Q), width=4, pass_cost=BENT), samples, AVERSE_P, cfg)
    assert max(sizes) >= 2 and min(sizes) < 4  # siblings judged, and some left out
    observed = [out.count(t) for t in range(4)]
    assert chisquare(observed, (AVERSE_P[2] * samples).tolist()).pvalue > 1e-3, observed


def test_a_policy_that_prices_a_tree_node_by_its_own_draw_is_caught(monkeypatch):
    """Planted: each node's worth with its own probability taken as the drawn token's under q (a rule that peeks)."""
    mutate(monkeypatch, GrowingDraft, "kept", ("tree_size([nodes[i].worth for i in order]",
                                               "tree_size([nodes[i].worth * float(self.qs[nodes[i].q_row][nodes[i].token])"
                                               " / nodes[i].prob for i in order]"))
    with pytest.raises(AssertionError, match="assert np.float64"):
        test_trees_the_policy_sizes_by_calibrated_worths_emit_exactly_p()
