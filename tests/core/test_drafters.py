"""The drafters (drafters.py, lookup.py): what each proposes, its n-gram guesses and its cut, each lossless."""
import dataclasses
import itertools
import math
import operator

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec_core import SpecConfig, autoregressive_generate, generate, speculative_generate
from specdec_core.drafters import ModelDrafter, make_drafter, rare_tokens
from specdec_core.lookup import Ngrams, PromptLookupDrafter
from specdec_core.models import Pair
from specdec_core.models.tiny import NOMINAL_COSTS
from specdec_core.policy import RECENT, Policy
from specdec_core.theory import PassCosts

from ..conftest import with_eos

PROMPT = "def fib(n):"


def test_prompt_lookup_and_early_exit_are_lossless(tiny):
    prompt = "abcabcabcabc abc abc abcabc"
    pair = with_eos(tiny, [])
    for drafter in (PromptLookupDrafter(), make_drafter(pair, "early-exit")):
        # no chat template: the prompt's last tokens occurred earlier in it, so prompt lookup proposes at once
        for cfg in (SpecConfig(k=4, max_new_tokens=40, chat=False), SpecConfig(k=3, max_new_tokens=17, chat=False)):
            run = generate(pair, prompt, cfg, drafter=drafter)
            assert run.token_ids == generate(pair, prompt, cfg, "autoregressive").token_ids
            assert any(e.drafted for e in run.events)  # something was proposed and judged


def test_prompt_lookup_proposes_after_a_match_of_two_tokens_or_more():
    """A match of one token is mostly a common token's latest continuation (after a comma, a space): wrong, and on
    a CPU a wrong 16-token proposal costs a 17-row pass, about 2.5 steps, for one token. Prompt lookup proposes
    what followed the last 2 or 3 tokens where they occurred before."""
    drafter, cfg = PromptLookupDrafter(), SpecConfig()
    assert len(drafter.propose([5, 6, 7, 8, 9, 6], 4, cfg, None)) == 0  # 6 occurred before, "9 6" did not
    assert drafter.propose([5, 6, 7, 8, 9, 5, 6], 4, cfg, None).tokens.tolist() == [7, 8, 9, 5]  # "5 6" did


def test_hybrid_copies_when_it_can_and_drafts_otherwise(tiny):
    hybrid = make_drafter(tiny, "hybrid")
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 40, 5, 6, 7]  # the last 3-gram occurred before, followed by 8 9 10 11
    list(hybrid.start(ids))  # the prefill runs as it is iterated
    copied = hybrid.propose(ids, 4, SpecConfig(min_confidence=0.0), None)
    assert copied.tokens.tolist() == [8, 9, 10, 11] and copied.q is None
    assert hybrid.model.lm.length == len(ids) - 1  # the draft model did not run
    drafted = hybrid.propose(ids + [99, 98], 4, SpecConfig(min_confidence=0.0), None)  # no earlier 3-gram: the model drafts
    # it caught up on the 3 tokens it had not seen, then fed its own first 3 drafts
    assert len(drafted) == 4 and drafted.expected > 0 and hybrid.model.lm.length == len(ids) + 2 + 3  # a copy expects 0


def test_hybrid_pauses_copying_after_a_copy_the_target_rejected(tiny):
    hybrid = make_drafter(tiny, "hybrid")
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 40, 5, 6, 7]
    list(hybrid.start(ids))  # the prefill runs as it is iterated
    copied = lambda draft: draft.expected == 0  # the draft model's drafts carry its own estimate; a copy none
    assert copied(hybrid.propose(ids, 4, SpecConfig(), None))
    ids = ids + [8]  # none of the 4 copied tokens accepted, only the target's own: "8" again, so a copy is
    # possible, but the next two rounds go to the model
    for _ in range(2):
        assert not copied(hybrid.propose(ids, 4, SpecConfig(), None))
    assert copied(hybrid.propose(ids, 4, SpecConfig(), None))


def test_hybrid_is_lossless_across_copied_and_drafted_rounds(tiny):
    pair, cfg = with_eos(tiny, []), SpecConfig(k=4, max_new_tokens=150)
    out = generate(pair, "abcabcabcabc abc abc abcabc", cfg, drafter=make_drafter(pair, "hybrid"))
    assert out.token_ids == generate(pair, "abcabcabcabc abc abc abcabc", cfg, "autoregressive").token_ids
    assert 0 < sum(1 for e in out.events if e.drafted and e.expected == 0) < len(out.events)  # copied, and drafted


def test_low_draft_confidence_stops_the_draft_early_and_stays_lossless(tiny):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=8, max_new_tokens=48, min_confidence=0.5, record_top=1)
    out = generate(pair, PROMPT, cfg, drafter=ModelDrafter(pair.cached("draft"), cut_on_device=False))
    assert out.token_ids == generate(pair, PROMPT, cfg, "autoregressive").token_ids
    assert any(len(e.drafted) < e.k for e in out.events)
    # cut exactly where the product of the draft's top probabilities falls below 0.5 (this draft's trust stays 1)
    for e in out.events:
        sure = confidences(e)
        assert all(s >= 0.5 for s in sure[:-1])
        assert len(e.drafted) == e.k or sure[-1] < 0.5


def test_a_gpu_chain_verifies_every_token_it_drafted(tiny):
    """A GPU drafts all k without reading the draft's confidence, and a pass of k + 1 rows costs it what a shorter one
    does: every drafted token is verified, however unsure the draft was (here below the cut in most rounds)."""
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=8, max_new_tokens=48, min_confidence=0.5, record_top=1)
    out = generate(pair, PROMPT, cfg, drafter=ModelDrafter(pair.cached("draft"), cut_on_device=True))
    assert out.token_ids == generate(pair, PROMPT, cfg, "autoregressive").token_ids
    assert all(len(e.drafted) == e.k for e in out.events)
    assert sum(confidences(e)[-1] < 0.5 for e in out.events) > len(out.events) / 2


def confidences(event) -> list[float]:
    """The draft's confidence in each prefix of its chain: the product of its top probabilities."""
    return [math.prod(top[0][1] for top in event.draft_top[: i + 1]) for i in range(len(event.drafted))]


# a CPU's costs, in target steps: a draft forward about a third of a step, a pass 0.15 a step more a token
CPU_COSTS = PassCosts({1: 1.0, 2: 1.15, 4: 1.45, 8: 2.05, 16: 3.25, 65: 10.6}, draft=0.31)


def test_each_round_drafts_what_the_policy_reads_from_the_rounds_before():
    """The policy (policy.py), replayed on the events alone: before each round, its forecast from the verdicts of the
    rounds before says whether to draft at all (a plain step where it does not pay); within it, the chain goes on
    exactly while the next token's forecast worth raises the expected tokens per unit time. Two random models over
    six tokens: the draft is sure of itself and mostly wrong, so plain steps come, and drafting comes back as old
    verdicts fade. Greedy output stays plain decoding's; a new generation starts from the prior again."""
    pair, prompt = dataclasses.replace(small_vocabulary_pair(), pass_costs=CPU_COSTS), [0, 1, 2, 3, 4, 5, 1, 2]
    cfg = SpecConfig(k=8, max_new_tokens=120, min_confidence=0.0, record_top=1, guess=0)
    drafter = make_drafter(pair)
    events = list(speculative_generate(pair, prompt, cfg, drafter))
    assert [t for e in events for t in e.committed] == [t for e in autoregressive_generate(pair, prompt, cfg)
                                                        for t in e.committed]
    replay = Policy(CPU_COSTS)
    for e in events:
        n, curve, value = replay.plan(e.k)
        assert e.curve == pytest.approx(curve) and (n == 0) == (not e.drafted)
        worths = list(itertools.accumulate((replay.worth(top[0][1]) for top in e.draft_top), operator.mul))
        probs = [top[0][1] for top in e.draft_top]
        go_on = lambda j: replay.go_on(worths[:j], replay.next_rate(probs[j - 1], j + 1))
        assert all(go_on(j) for j in range(1, len(worths)))
        assert not e.drafted or len(e.drafted) == e.k or not go_on(len(worths))
        assert e.gain == pytest.approx(replay.gain(worths) if e.drafted else value)
        judged = range(1, min(e.accepted + 1, len(e.drafted)) + 1)
        replay.learn([(d, e.draft_top[d - 1][0][1], d <= e.accepted) for d in judged])
    drafter.settle(prompt + [t for e in events for t in e.committed])  # the last round's verdicts, as a next round
    assert drafter.policy.by_depth.judged == pytest.approx(replay.by_depth.judged)
    plain = [not e.drafted for e in events[:-1]]
    assert 5 < sum(plain) < len(plain) - 5 and any(a and not b for a, b in itertools.pairwise(plain))  # and back
    assert len({len(e.drafted) for e in events}) > 2
    list(drafter.start(prompt))  # the prefill runs as it is iterated
    assert not drafter.policy.by_depth.judged


def test_the_policy_reads_each_rounds_pass_time_when_the_next_round_settles():
    """The engine tells each draft how long the target took over it (plain steps too); the policy's step is
    the fastest of its latest passes, each counted at its rows (drafted tokens + 1) as the pass costs say."""
    costs = dataclasses.replace(CPU_COSTS, step_ms=20.0)
    pair, prompt = dataclasses.replace(small_vocabulary_pair(), pass_costs=costs), [0, 1, 2, 3, 4, 5, 1, 2]
    drafter = make_drafter(pair)
    events = list(speculative_generate(pair, prompt, SpecConfig(k=8, max_new_tokens=60, guess=0), drafter))
    # the last round's time is read by a round that never comes
    steps = [e.verify_s / costs.verify(len(e.drafted) + 1) for e in events[:-1]]
    assert drafter.policy.step_s == pytest.approx(min(steps[-RECENT:])) and min(steps[-RECENT:]) != 0.020
    assert {len(e.drafted) for e in events} > {0}  # drafted rounds and plain steps both counted


def scanned(ids: list[int], k: int, most: int = 3) -> list[int]:
    """Prompt lookup by scanning: the continuation of the latest earlier occurrence of the longest n-gram ending ids."""
    for n in range(min(most, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + k]
    return []


def test_the_n_gram_index_finds_what_a_scan_finds():
    """Ngrams indexes a sequence as it grows (and afresh when it is not a continuation): every lookup agrees with a
    scan of the whole sequence."""
    g = torch.Generator().manual_seed(0)
    ngrams, found = Ngrams(), 0
    for _ in range(3):  # three unrelated sequences through one index
        ids = []
        for _ in range(60):
            ids = ids + torch.randint(0, 5, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            n, after = ngrams.after(ids, ids, 4)
            assert after == scanned(ids, 4) and (n > 0) == bool(after)
            found += bool(after)
    assert found > 100


def small_vocabulary_pair(vocab: int = 6) -> Pair:
    """A target and a draft over 6 tokens, random and sharp: their text soon repeats, so lookups find n-grams."""
    torch.manual_seed(0)
    target, draft = (Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, initializer_range=0.8, tie_word_embeddings=False)).eval() for _ in range(2))
    return Pair("six", target, draft, None, vocab, frozenset(), 512, torch.device("cpu"), torch.float32,
                pass_costs=NOMINAL_COSTS)


def drafts_of(pair, prompt, cfg) -> tuple[list, int, ModelDrafter]:
    """Each round's draft and committed tokens, the draft forwards they took, and the drafter."""
    drafter, calls = ModelDrafter(pair.cached("draft")), []
    forward = drafter.lm.forward
    drafter.lm.forward = lambda ids, *a, **kw: calls.append(ids.numel()) or forward(ids, *a, **kw)
    events = list(speculative_generate(pair, prompt, cfg, drafter))
    assert sum(e.draft_steps for e in events) == len(calls) - 1  # every forward but the prompt's, as the events say
    return [(e.drafted, e.committed) for e in events], len(calls), drafter


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guesses_save_draft_forwards_and_change_no_draft(temperature):
    """A chain's forwards carry what followed its n-gram earlier: every round drafts and commits what it does
    without guesses (same seed), in fewer draft forwards; greedy output is plain decoding's."""
    pair, prompt = small_vocabulary_pair(), [0, 1, 2, 3, 4, 5, 1, 2]
    cfg = SpecConfig(k=8, max_new_tokens=120, temperature=temperature, min_confidence=0.0)
    plain, plain_forwards, _ = drafts_of(pair, prompt, dataclasses.replace(cfg, guess=0))
    guessed, forwards, drafter = drafts_of(pair, prompt, cfg)
    assert guessed == plain
    assert drafter.guessed > 20 and forwards == plain_forwards - drafter.guessed
    if not temperature:
        assert [t for _, committed in guessed for t in committed] == \
            [t for e in autoregressive_generate(pair, prompt, cfg) for t in e.committed]


def int4_head_pair() -> Pair:
    """A float32 target over 16 tokens and its int4 copy as the draft, whose steps are written out (DraftStep) and
    whose head is int4 too (16 outputs: int4_vnni's tiles)."""
    from specdec_core.models import step as step_module
    from specdec_core.models.kernels import int4_vnni
    from specdec_core.models.quant import Int4Linear, draft_to_int4
    from specdec_core.models.step import DraftStep
    if step_module.ops() is None or int4_vnni.library()[0] is None:
        pytest.skip("the draft's written-out step or its int4 product cannot be built here (a warning said why)")
    torch.manual_seed(3)  # a target that writes ids 8-11 a quarter of the time after its prompts
    target = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                                          tie_word_embeddings=False)).eval()
    draft = Qwen2ForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    draft = draft_to_int4(draft.to(torch.bfloat16))
    assert isinstance(draft.lm_head, Int4Linear) and draft.lm_head.tiles is not None and DraftStep.fits(draft)
    return Pair("sixteen", target, draft, None, 16, frozenset(), 512, torch.device("cpu"), torch.float32,
                pass_costs=NOMINAL_COSTS, written={"draft": DraftStep(draft)})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_without_the_rare_tokens_drafts_none_until_the_text_holds_one(temperature, monkeypatch):
    """The draft's steps leave ids [8, 12) out of its head (q = 0 there) until the target writes one; from then on
    it drafts over all. Greedy output is plain decoding's, rare tokens included: they come from the target."""
    from specdec_core.models.quant import Int4Linear
    pair, prompt = int4_head_pair(), [1, 2, 3, 4, 5, 6, 7, 1, 2]
    skipped = []
    without = Int4Linear.without
    monkeypatch.setattr(Int4Linear, "without", lambda self, x, skip: skipped.append(skip) or without(self, x, skip))
    cfg = SpecConfig(k=4, max_new_tokens=60, temperature=temperature, seed=1)
    drafter = ModelDrafter(pair.cached("draft"), rare=(8, 12))
    events = list(speculative_generate(pair, prompt, cfg, drafter))
    committed = [t for e in events for t in e.committed]
    first = next(i for i, e in enumerate(events) if any(8 <= t < 12 for t in e.committed))  # the target wrote one
    before = [t for e in events[: first + 1] for t in e.drafted]
    assert before and not any(8 <= t < 12 for t in before) and set(skipped) == {(8, 12)}
    assert drafter.lm.skip is None and any(8 <= t < 12 for e in events[first + 1:] for t in e.drafted)
    if not temperature:
        assert committed == [t for e in autoregressive_generate(pair, prompt, cfg) for t in e.committed]


def test_only_qwen2s_vocabulary_has_rare_tokens_left_out(tiny):
    """rare_tokens: Qwen2's ids from 98,304 to its first special token (151,643), cut to int4 tiles' rows of 4."""
    qwen2 = type("Tokenizer", (), {"convert_tokens_to_ids": lambda self, token: {"<|endoftext|>": 151643}[token]})()
    assert rare_tokens(dataclasses.replace(tiny, tokenizer=qwen2)) == (98304, 151640)
    assert rare_tokens(tiny) is None and make_drafter(tiny, "model").rare is None
