"""The engine on the tiny pair: greedy equality, EOS, length caps, seeds and cache invariants."""
import dataclasses
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec_core import SpecConfig, autoregressive_generate, generate, speculative_generate
from specdec_core.drafters import ModelDrafter, make_drafter
from specdec_core.lookup import Ngrams, PromptLookupDrafter
from specdec_core.models import Pair

from ..conftest import FLAT_COSTS, with_eos

PROMPT = "def fib(n):"


@pytest.mark.parametrize("draft", ["same", "perturbed", "unrelated"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_autoregressive(tiny_set, draft, k):
    pair = tiny_set[draft]
    eos_free = with_eos(pair, [])  # run to the length cap so every case compares full sequences
    for n in sorted({1, max(1, k - 1), k, k + 1, 64}):
        cfg = SpecConfig(k=k, max_new_tokens=n)
        ar = generate(eos_free, PROMPT, cfg, "autoregressive")
        spec = generate(eos_free, PROMPT, cfg)
        assert spec.token_ids == ar.token_ids, (draft, k, n)
        assert len(spec.token_ids) == n
        if draft == "same" and n > 1:
            assert spec.stats.drafted > 0 and spec.stats.acceptance_rate == 1.0


def test_acceptance_spans_full_partial_and_zero(tiny_set):
    stats = generate(with_eos(tiny_set["perturbed"], []), PROMPT, SpecConfig(k=4, max_new_tokens=64)).stats
    hist = stats.accepted_length_histogram
    assert hist[0] > 0 and hist[-1] > 0 and sum(hist[1:-1]) > 0
    assert generate(with_eos(tiny_set["unrelated"], []), PROMPT,
                    SpecConfig(k=4, max_new_tokens=32)).stats.acceptance_rate < 0.2


@pytest.mark.parametrize("draft", ["same", "perturbed"])
def test_eos_anywhere_in_a_round_ends_generation_there(tiny_set, draft):
    pair = with_eos(tiny_set[draft], [])
    cfg = SpecConfig(k=4, max_new_tokens=24)
    reference = generate(pair, PROMPT, cfg, "autoregressive").token_ids
    for pos in range(len(reference)):  # with draft == target, pos covers every draft position and the bonus
        eos = reference[pos]
        expected = reference[: reference.index(eos) + 1]
        out = generate(with_eos(pair, [eos]), PROMPT, cfg)
        assert out.token_ids == expected
        assert out.stats.finish_reason == "eos"


def test_max_new_tokens_never_exceeded_when_sampling(tiny):
    for n in (1, 2, 3, 5, 9):
        for seed in range(5):
            out = generate(with_eos(tiny, []), PROMPT, SpecConfig(k=4, max_new_tokens=n, temperature=1.0, seed=seed))
            assert len(out.token_ids) == n
            assert all(e.k <= 4 and len(e.committed) <= e.k + 1 for e in out.events)


def test_same_seed_same_output_and_seeds_matter(tiny):
    cfg = SpecConfig(k=3, temperature=1.0, max_new_tokens=40, seed=7)
    a, b = generate(tiny, PROMPT, cfg), generate(tiny, PROMPT, cfg)
    assert a.token_ids == b.token_ids and a.text == b.text
    others = {tuple(generate(tiny, PROMPT, SpecConfig(k=3, temperature=1.0, max_new_tokens=40, seed=s)).token_ids)
              for s in range(4)}
    assert len(others) > 1
    ar = SpecConfig(temperature=0.8, top_p=0.9, max_new_tokens=20, seed=3)
    assert generate(tiny, PROMPT, ar, "autoregressive").token_ids == generate(tiny, PROMPT, ar, "autoregressive").token_ids


def test_cache_lengths_after_every_round(tiny):
    drafter = ModelDrafter(tiny.cached("draft"))
    cfg = SpecConfig(k=4, max_new_tokens=48)
    n_prompt = None
    for e in speculative_generate(with_eos(tiny, []), PROMPT, cfg, drafter):
        n_prompt = n_prompt or (drafter.lm.length - e.n_generated + 1 if e.accepted < len(e.drafted) else None)
        n_ids = drafter.lm.length + (2 if e.accepted == len(e.drafted) else 1)  # bonus leaves two tokens unfed
        drafter.lm.check()
        if n_prompt is not None:
            assert n_ids == n_prompt + e.n_generated
    assert n_prompt is not None


def test_events_carry_what_the_ui_needs(tiny):
    cfg = SpecConfig(k=4, max_new_tokens=30, temperature=1.0, record_top=5)  # the inspector's top-5 lists
    events = list(speculative_generate(tiny, PROMPT, cfg))
    first = events[0]
    assert first.prefill_s > 0 and all(e.prefill_s == 0 for e in events[1:])
    assert all(e.elapsed_s > 0 for e in events) and events == sorted(events, key=lambda e: e.elapsed_s)
    for e in events:
        assert len(e.p_drafted) == len(e.q_drafted) == len(e.accept_probs) == len(e.uniforms) == len(e.drafted)
        assert len(e.target_top) == len(e.drafted) + 1 and len(e.draft_top) == len(e.drafted)
        assert (e.residual_top is None) == (e.token_kind == "bonus")
        for row in e.target_top + e.draft_top + ([e.residual_top] if e.residual_top else []):
            values = [v for _, v in row]
            assert len(row) == 5 and values == sorted(values, reverse=True)
        assert e.committed == (e.drafted[: e.accepted] + [e.token])[: len(e.committed)]  # cut only at EOS
        for a, p, q in zip(e.accept_probs, e.p_drafted, e.q_drafted):
            assert a == pytest.approx(min(1.0, p / q), rel=1e-5)
    assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_events_carry_no_top_lists_unless_asked(tiny):
    cfg = SpecConfig(k=4, max_new_tokens=30, temperature=1.0)
    bare, full = (list(speculative_generate(tiny, PROMPT, c)) for c in (cfg, dataclasses.replace(cfg, record_top=5)))
    assert [e.committed for e in bare] == [e.committed for e in full]
    assert all(e.residual_top is None and not any(e.target_top) and not any(e.draft_top) for e in bare)


def test_autoregressive_is_one_event_per_token(tiny):
    events = list(autoregressive_generate(with_eos(tiny, []), PROMPT, SpecConfig(max_new_tokens=10)))
    assert len(events) == 10 and all(len(e.committed) == 1 and e.token_kind == "target" for e in events)


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
    hybrid.start(ids)
    copied = hybrid.propose(ids, 4, SpecConfig(min_confidence=0.0), None)
    assert copied.tokens.tolist() == [8, 9, 10, 11] and copied.q is None
    assert hybrid.model.lm.length == len(ids) - 1  # the draft model did not run
    drafted = hybrid.propose(ids + [99, 98], 4, SpecConfig(min_confidence=0.0), None)  # no earlier 3-gram: the model drafts
    # it caught up on the 3 tokens it had not seen, then fed its own first 3 drafts
    assert len(drafted) == 4 and drafted.expected > 0 and hybrid.model.lm.length == len(ids) + 2 + 3  # a copy expects 0


def test_hybrid_pauses_copying_after_a_copy_the_target_rejected(tiny):
    hybrid = make_drafter(tiny, "hybrid")
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 40, 5, 6, 7]
    hybrid.start(ids)
    copied = lambda draft: draft.expected == 0  # the draft model's drafts carry its own estimate; a copy none
    assert copied(hybrid.propose(ids, 4, SpecConfig(), None))
    hybrid.commit(ids + [8])  # none of the 4 copied tokens accepted, only the target's own
    ids = ids + [8]  # "8" again: a copy is possible, but the next two rounds go to the model
    for _ in range(2):
        assert not copied(hybrid.propose(ids, 4, SpecConfig(), None))
        hybrid.commit(ids)
    assert copied(hybrid.propose(ids, 4, SpecConfig(), None))


def test_hybrid_is_lossless_across_copied_and_drafted_rounds(tiny):
    pair, cfg = with_eos(tiny, []), SpecConfig(k=4, max_new_tokens=150)
    out = generate(pair, "abcabcabcabc abc abc abcabc", cfg, drafter=make_drafter(pair, "hybrid"))
    assert out.token_ids == generate(pair, "abcabcabcabc abc abc abcabc", cfg, "autoregressive").token_ids
    assert 0 < sum(1 for e in out.events if e.drafted and e.expected == 0) < len(out.events)  # copied, and drafted


def test_adaptive_k_changes_k_and_stays_lossless(tiny):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=4, max_new_tokens=64, adaptive=True)
    out = generate(pair, PROMPT, cfg)
    assert out.token_ids == generate(pair, PROMPT, cfg, "autoregressive").token_ids
    assert len({e.k for e in out.events}) > 1


def test_bad_prompts_raise_clear_errors(tiny):
    for bad in ("", "   \n\t"):
        with pytest.raises(ValueError, match="empty"):
            generate(tiny, bad, SpecConfig())
    with pytest.raises(ValueError, match="context"):
        generate(tiny, "x" * 5000, SpecConfig(max_new_tokens=10))


@pytest.mark.parametrize("on_device", [False, True])  # a CPU stops drafting there; a GPU drafts k and cuts after
def test_low_draft_confidence_stops_the_draft_early_and_stays_lossless(tiny, on_device):
    pair = with_eos(tiny, [])
    cfg = SpecConfig(k=8, max_new_tokens=48, min_confidence=0.5, record_top=1)
    out = generate(pair, PROMPT, cfg, drafter=ModelDrafter(pair.cached("draft"), cut_on_device=on_device))
    assert out.token_ids == generate(pair, PROMPT, cfg, "autoregressive").token_ids
    assert any(len(e.drafted) < e.k for e in out.events)
    for e in out.events:  # cut exactly where the product of the draft's top probabilities falls below 0.5
        sure = [math.prod(top[0][1] for top in e.draft_top[: i + 1]) for i in range(len(e.drafted))]
        assert all(s >= 0.5 for s in sure[:-1])
        assert len(e.drafted) == e.k or sure[-1] < 0.5


def test_the_race_runs_the_decoder_behind_on_its_own_clock_next():
    from types import SimpleNamespace

    from specdec_core.race import interleave

    clock = lambda *times: iter(SimpleNamespace(elapsed_s=t) for t in times)
    order = [(name, e.elapsed_s) for name, e in interleave({"plain": clock(1.0, 2.0, 3.0), "spec": clock(2.5, 2.6)})]
    assert order == [("plain", 1.0), ("spec", 2.5), ("plain", 2.0), ("plain", 3.0), ("spec", 2.6)]


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
                pass_costs=FLAT_COSTS)


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
