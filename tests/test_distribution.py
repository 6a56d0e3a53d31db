"""Whole-sequence check: speculative sampling draws sequences from exactly the target's distribution.

Two context-dependent toy models over a 4-token vocabulary; the exact probability of every
3-token continuation is computed by enumeration and compared with speculative samples by a
chi-square test (fixed seeds, so the test is deterministic). The same test with the residual
replaced by p (a classic bug) must fail, which shows the sample is large enough to notice.
"""
import importlib
import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec_core import SpecConfig, make_drafter, speculative_generate
from specdec_core.drafters import HybridDrafter, ModelDrafter
from specdec_core.models import Pair
from specdec_core.sampling import logits_to_probs

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
    return Pair("toy", target, draft, None, VOCAB, frozenset(), 64, cpu, torch.float32)


def exact_distribution(pair, warp):
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=LENGTH):
            logits = pair.target(torch.tensor([PROMPT + list(seq)])).logits[0]
            p = warp(logits[len(PROMPT) - 1: -1])
            probs[seq] = float(torch.prod(p[torch.arange(LENGTH), torch.tensor(seq)]))
    return probs


def sample_counts(pair, cfg, drafter):
    counts = {}
    for seed in range(SAMPLES):
        made = drafter(pair) if callable(drafter) else make_drafter(pair, drafter, layers=1)
        events = speculative_generate(pair, PROMPT, SpecConfig(seed=seed, **cfg), made)
        seq = tuple(t for e in events for t in e.committed)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def p_value(pair, cfg, drafter="model"):
    warp = lambda logits: logits_to_probs(logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0))
    exact = exact_distribution(pair, warp)
    counts = sample_counts(pair, cfg, drafter)
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


TREE = dict(CFG, tree_nodes=5)


def narrow_tree(pair):  # two children a node, both expanded: siblings not drawn first carry a renormalised q
    return ModelDrafter(pair.cached("draft"), width=2, expand=2)


@pytest.mark.parametrize("cfg, drafter", [(CFG, "model"), (dict(CFG, temperature=0.7, top_p=0.9), "model"),
                                           (CFG, "prompt-lookup"), (CFG, "early-exit"), (CFG, hybrid),
                                           (TREE, "model"), (TREE, narrow_tree), (dict(TREE, temperature=0.7, top_k=3),
                                                                                  "model"), (TREE, "early-exit")])
def test_speculative_samples_follow_the_target(toy_pair, cfg, drafter):
    assert p_value(toy_pair, cfg, drafter) > 1e-3


def test_a_wrong_residual_is_detected(toy_pair, monkeypatch):
    monkeypatch.setattr(importlib.import_module("specdec_core.verify"), "residual_distribution", lambda p, q: p)
    assert p_value(toy_pair, CFG) < 1e-3


def test_a_tree_rule_without_renormalised_siblings_is_detected(toy_pair, monkeypatch):
    """Judging a later sibling against the draft's whole q, as if drawn with replacement, is a classic bug."""
    monkeypatch.setattr(importlib.import_module("specdec_core.drafters"), "without", lambda q, tokens: q)
    assert p_value(toy_pair, TREE, narrow_tree) < 1e-3
