"""Whole-sequence check: speculative sampling draws sequences from exactly the target's distribution.

Two context-dependent toy models over a 4-token vocabulary; the exact probability of every
3-token continuation is computed by enumeration and compared with speculative samples by a
chi-square test (fixed seeds, so the test is deterministic). The same test with the residual
replaced by p (a classic bug) must fail, which shows the sample is large enough to notice.
"""
import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec_core import SpecConfig, drafters, make_drafter, policy, speculative_generate, verify
from specdec_core.drafters import ModelDrafter
from specdec_core.lookup import HybridDrafter, PromptLookupDrafter
from specdec_core.models import Pair
from specdec_core.models import step as step_module
from specdec_core.models.quant import draft_to_int4
from specdec_core.models.step import DraftStep
from specdec_core.models.tiny import NOMINAL_COSTS
from specdec_core.policy import Policy
from specdec_core.sampling import warp
from specdec_core.theory import PassCosts

from ..conftest import mutate

pytestmark = pytest.mark.slow  # 2,000 generations a test; the exact one-token check in test_verify.py is fast

VOCAB, LENGTH, SAMPLES = 4, 3, 2000
PROMPT = [0, 2, 1]
CFG = dict(k=2, temperature=1.0, max_new_tokens=LENGTH)


def toy(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.8, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def toy_pair():
    target, draft = toy(1), toy(2)
    cpu = torch.device("cpu")
    return Pair("toy", target, draft, None, VOCAB, frozenset(), 64, cpu, torch.float32, pass_costs=NOMINAL_COSTS)


def exact_distribution(pair, warp, prompt, length=LENGTH):
    """Every continuation of `length` tokens and its probability under the target, warped as sampled."""
    probs, seqs = {}, torch.tensor(list(itertools.product(range(pair.vocab), repeat=length)))
    with torch.no_grad():
        for chunk in seqs.split(4096):
            ids = torch.cat([torch.tensor(prompt).expand(len(chunk), -1), chunk], 1)
            p = warp(pair.target(ids).logits[:, len(prompt) - 1: -1].reshape(-1, pair.vocab)).view(*chunk.shape, -1)
            chosen = p.gather(2, chunk.unsqueeze(2)).squeeze(2).prod(1)
            probs.update(zip(map(tuple, chunk.tolist()), chosen.tolist()))
    return probs


def sample_counts(pair, cfg, drafter, prompt):
    counts = {}
    for seed in range(SAMPLES):
        made = drafter(pair) if callable(drafter) else make_drafter(pair, drafter, SpecConfig(**cfg))
        events = speculative_generate(pair, prompt, SpecConfig(seed=seed, **cfg), made)
        seq = tuple(t for e in events for t in e.committed)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def p_value(pair, cfg, drafter="model", prompt=PROMPT):
    warped = lambda logits: warp(logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0))[0]
    exact = exact_distribution(pair, warped, prompt, cfg["max_new_tokens"])
    counts = sample_counts(pair, cfg, drafter, prompt)
    assert set(counts) <= {s for s, p in exact.items() if p > 0}
    seqs = sorted(exact, key=exact.get, reverse=True)
    observed, expected = [], []
    for s in seqs:  # pool the rare sequences into one bin so every expected count is >= 5
        if exact[s] * SAMPLES >= 5:
            observed.append(counts.get(s, 0))
            expected.append(exact[s] * SAMPLES)
    observed.append(SAMPLES - sum(observed))
    expected.append(SAMPLES - sum(expected))
    return chisquare(observed, expected).pvalue


def hybrid(pair):  # copying from a single earlier token, so that copied and drafted rounds both happen
    return HybridDrafter(ModelDrafter(pair.cached("draft")), min_ngram=1)


def lookup(pair):  # from a single earlier token, so that its proposals are frequent in three tokens of four ids
    return PromptLookupDrafter(min_ngram=1)


TREE = dict(CFG, tree_nodes=5)


def narrow_tree(pair):  # two children a node, both expanded: siblings not drawn first carry a renormalised q
    return ModelDrafter(pair.cached("draft"), width=2, expand=2)


# Rows cheap at first and dearer further: the policy grows and cuts trees (to 0-3 nodes of 5 here), by a rule that
# must not look at what was drawn
UNEVEN = PassCosts({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.2, 16: 4.0, 65: 14.0}, draft=0.2)


def cost_sized_tree(pair):
    return ModelDrafter(pair.cached("draft"), width=3, expand=2, pass_cost=UNEVEN)


def device_chain(pair):  # the GPU path: drafts all k without a read, verifies them all
    return ModelDrafter(pair.cached("draft"), cut_on_device=True)


CUT = dict(CFG, k=3, min_confidence=0.5)


@pytest.mark.parametrize("cfg, drafter", [(CFG, "model"), (dict(CFG, temperature=0.7, top_p=0.9), "model"),
                                           (CFG, lookup), (CFG, "early-exit"), (CFG, hybrid),
                                           (TREE, "model"), (TREE, narrow_tree), (dict(TREE, temperature=0.7, top_k=3),
                                                                                  "model"), (TREE, "early-exit"),
                                           (dict(TREE, k=3), cost_sized_tree), (CUT, device_chain),
                                           (dict(CUT, temperature=0.7), device_chain)])
def test_speculative_samples_follow_the_target(toy_pair, cfg, drafter):
    assert p_value(toy_pair, cfg, drafter) > 1e-3


# a draft forward 0.35 of a step, 0.2 a row: the policy's prior drafts, and one rejection is enough to make the
# next round a plain step
DEAR = PassCosts({1: 1.0, 2: 1.2, 65: 13.8}, draft=0.35)
LONG = dict(CFG, max_new_tokens=8)  # answers long enough for a probe that drafting did not follow to delay the next


def test_chains_the_policy_shortens_follow_the_target(toy_pair, monkeypatch):
    """The policy (policy.py) sets each round's length from the rounds before and the draft's own draws, never this
    round's verification: some rounds are plain steps, others chains or probes, and a probe that drafting did not
    follow makes the next wait longer (a plain step where one probe fewer would have drafted); passes are priced as
    the rounds took them (set here: a draft forward 0.35 of a step, passes of more than two tokens half what DEAR
    says); the samples of 8 tokens still follow the target. Dropping the token where the chain stops when its own draw
    was unlikely (a rule that reads the token drawn) is caught."""
    lengths, delayed, cheaper, step = [], [], [], 0.010
    plan, observe, passed = Policy.plan, Policy.observe, Policy.passed

    def planned(self, k, reads=True):
        waited = self.plain_run
        n, curve, value = plan(self, k, reads)
        lengths.append(n)
        delayed.append(not n and self.misses and waited * policy.EXPLORE >= curve[0] - value)
        cheaper.append(self.verify[3] < DEAR.verify(3))
        return n, curve, value
    monkeypatch.setattr(Policy, "plan", planned)
    monkeypatch.setattr(Policy, "observe", lambda self, first_s, rest_s, forwards, tokens: observe(
        self, 0.35 * step, 0.35 * step * (forwards - 1), forwards, tokens))
    monkeypatch.setattr(Policy, "passed", lambda self, seconds, rows: passed(
        self, step * DEAR.verify(rows) * (0.5 if rows > 2 else 1), rows))
    monkeypatch.setattr(policy, "EXPLORE", 0.05)  # probes soon enough for a delayed one within 8 tokens
    pair = dataclasses.replace(toy_pair, pass_costs=dataclasses.replace(DEAR, step_ms=1000 * step))
    assert p_value(pair, LONG) > 1e-3
    assert {0, 1} <= set(lengths) and any(delayed) and any(cheaper)
    mutate(monkeypatch, ModelDrafter, "grow", ("            break\n", "            if g.qs[-1][g.nodes[-1].token] < 0.5:\n"
                                               "                g.nodes.pop()\n            break\n"))
    assert p_value(pair, LONG) < 1e-3


def test_prompt_lookup_s_samples_follow_the_target(toy_pair):
    """As it is made by name: proposing after a match of 2 tokens or more. The prompt ends with a 2-gram it holds
    earlier, so the first round proposes what followed it."""
    assert len(PromptLookupDrafter().propose([0, 2, 1, 0, 2], 2, SpecConfig(**CFG), None)) == 2
    assert p_value(toy_pair, CFG, "prompt-lookup", prompt=[0, 2, 1, 0, 2]) > 1e-3


# ends with the 2-gram "3 2", which was followed by 2: the draft's first forward guesses 2 behind its node
REPEATING = [3, 2, 2, 1, 3, 2]


def test_chains_that_draw_guessed_tokens_follow_the_target(toy_pair):
    """A node drawn equal to the guess fed behind its parent takes its distribution from the guess's row; in about
    half the rounds here the node is another token, and the guess is cropped."""
    drafter = ModelDrafter(toy_pair.cached("draft"))
    rounds = [e for seed in range(30) for e in speculative_generate(toy_pair, REPEATING, SpecConfig(seed=seed, **CFG),
                                                                   drafter)]
    assert 10 < drafter.guessed < len(rounds) - 10
    assert p_value(toy_pair, CFG, prompt=REPEATING) > 1e-3


def test_cost_sized_trees_are_cut(toy_pair):
    """The case above runs its branch: trees cut to fewer nodes than drafted."""
    sizes = [len(e.drafted) for seed in range(30) for e in speculative_generate(
        toy_pair, PROMPT, SpecConfig(seed=seed, **dict(TREE, k=3)), cost_sized_tree(toy_pair))]
    assert 0 in sizes and max(sizes) > 1 and max(sizes) < TREE["tree_nodes"]


def test_the_written_out_int4_draft_steps_samples_follow_the_target(toy_pair):
    """The draft's decoding steps and prompts on CPUs (step.py: int4 products, step_ops.c between them) round their
    own way; whatever its logits, q is what the draft drew from. A draft of the shapes the int4 kernel takes, in bfloat16."""
    if step_module.ops() is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, initializer_range=0.8, tie_word_embeddings=False)
    draft = draft_to_int4(Qwen2ForCausalLM(cfg).eval().to(torch.bfloat16))
    step, taken = DraftStep(draft), []

    def spy(ids, cache, length, keep, tree=None, prompt=False, skip=None):
        logits = step(ids, cache, length, keep, tree, prompt, skip)
        taken.append((prompt, logits is not None))
        return logits
    spy.model = draft  # Pair.cached gives a model the steps made for it
    pair = dataclasses.replace(toy_pair, draft=draft, written={"draft": spy})
    assert DraftStep.fits(draft) and p_value(pair, CFG) > 1e-3
    steps, prompts = ([took for prompt, took in taken if prompt == kind] for kind in (False, True))
    assert len(steps) > SAMPLES and prompts and all(steps + prompts)  # every draft forward went through it
    assert {attention for _, attention in step.plans} == {"grouped"}  # step_ops.c's attention


def test_a_draft_head_without_the_rare_tokens_samples_the_target(monkeypatch):
    """The draft's steps leave ids [8, 12) of 16 out of its head (drafters.rare_tokens): q is 0 there, and only the
    residual writes them. Planted: a residual kept to q's support, which only such a head exposes."""
    from .test_drafters import int4_head_pair
    pair, cfg = int4_head_pair(), dict(CFG, max_new_tokens=2)
    rare = lambda pair: ModelDrafter(pair.cached("draft"), rare=(8, 12))
    warped = lambda logits: warp(logits, 1.0)[0]
    exact = exact_distribution(pair, warped, PROMPT, 2)
    assert sum(p for seq, p in exact.items() if any(8 <= t < 12 for t in seq)) > 0.05  # the target writes them
    assert p_value(pair, cfg, rare) > 1e-3
    mutate(monkeypatch, verify, "residual_distribution",
           ("r = (p - q).clamp(min=0.0)", "r = (p - q).clamp(min=0.0) * (q > 0)"))
    assert p_value(pair, cfg, rare) < 1e-3


def test_a_wrong_residual_is_detected(toy_pair, monkeypatch):
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    assert p_value(toy_pair, CFG) < 1e-3


def test_a_residual_one_token_short_is_detected(toy_pair, monkeypatch):
    """An off-by-one in the residual's support: the last token of the vocabulary never comes from it."""
    mutate(monkeypatch, verify, "residual_distribution",
           ("r = (p - q).clamp(min=0.0)", "r = (p - q).clamp(min=0.0)\n    r[..., -1] = 0.0"))
    assert p_value(toy_pair, CFG) < 1e-3


def test_a_tree_rule_without_renormalised_siblings_is_detected(toy_pair, monkeypatch):
    """Judging a later sibling against the draft's whole q, as if drawn with replacement, is a classic bug."""
    monkeypatch.setattr(drafters, "without", lambda q, tokens: q)
    assert p_value(toy_pair, TREE, narrow_tree) < 1e-3


def test_a_sibling_residual_renormalised_once_too_often_is_detected(toy_pair, monkeypatch):
    """After a rejected child, what is left is p - q of that child; taking q without the child's own token
    (renormalised once more: the next sibling's q) instead is subtly wrong."""
    mutate(monkeypatch, verify, "_decide_tree",
           ("q_c = q[c] if q is not None", "q_c = without(q[c], x) if q is not None"))
    monkeypatch.setitem(verify._decide_tree.__globals__, "without",
                        lambda q, x: q.index_fill(0, x, 0.0) / q.index_fill(0, x, 0.0).sum())
    assert p_value(toy_pair, TREE, narrow_tree) < 1e-3


def test_a_tree_that_keeps_a_node_only_when_accepted_is_detected(toy_pair, monkeypatch):
    """A rejected child dropped as if it had never been drafted: nothing is taken out of p for it."""
    mutate(monkeypatch, verify, "_decide_tree",
           ("cur = torch.where(taken | hit[c], cur,", "cur = torch.where(taken | hit[c] | True, cur,"),
           ("dist = torch.where(real, residual_distribution", "dist = torch.where(real & False, residual_distribution"))
    assert p_value(toy_pair, TREE, narrow_tree) < 1e-3
