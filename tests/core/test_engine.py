"""The engine on the tiny pair: greedy equality, EOS, length caps, seeds and cache invariants."""
import dataclasses

import pytest

from specdec_core import SpecConfig, autoregressive_generate, generate, speculative_generate
from specdec_core.drafters import ModelDrafter

from ..conftest import with_eos

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
    stats = generate(with_eos(tiny_set["perturbed"], []), PROMPT, SpecConfig(k=4, max_new_tokens=64, min_confidence=0.0)).stats
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


def test_the_draft_cache_holds_the_committed_tokens_when_each_round_drafts(tiny):
    """A round's drafter first brings the draft's cache to what the rounds before committed (settle): every committed
    token but the newest, and where a whole draft was accepted, its last drafted token too (never fed to the draft)."""
    drafter = ModelDrafter(tiny.cached("draft"))
    behind, settle = [], drafter.settle

    def settled(ids):
        settle(ids)
        drafter.lm.check()
        behind.append(len(ids) - drafter.lm.length)

    drafter.settle = settled
    events = list(speculative_generate(with_eos(tiny, []), PROMPT, SpecConfig(k=4, max_new_tokens=48), drafter))
    assert behind[0] == 1  # after the prefill: the prompt but its last token
    assert behind[1:] == [2 if e.accepted == len(e.drafted) else 1 for e in events[:-1]]
    assert {1, 2} <= set(behind[1:])


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


def test_the_race_runs_the_decoder_behind_on_its_own_clock_next():
    from types import SimpleNamespace

    from specdec_core.race import interleave

    clock = lambda *times: iter(SimpleNamespace(elapsed_s=t) for t in times)
    order = [(name, e.elapsed_s) for name, e in interleave({"plain": clock(1.0, 2.0, 3.0), "spec": clock(2.5, 2.6)})]
    assert order == [("plain", 1.0), ("spec", 2.5), ("plain", 2.0), ("plain", 3.0), ("spec", 2.6)]


