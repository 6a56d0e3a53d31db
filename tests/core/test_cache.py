"""Static caches and compiled steps (the GPU path) decode exactly what dynamic caches decode."""
import copy
import dataclasses

import pytest
import torch

from specdec_core import SpecConfig, autoregressive_generate, generate, speculative_generate
from specdec_core.cache import CachedModel
from specdec_core.models import enable_graphs, make_pair
from specdec_core.models.attention import GROUPED
from specdec_core.models.quant import quantise_target
from specdec_core.models.tiny import NOMINAL_COSTS, tiny_models

CONFIGS = [SpecConfig(k=4, max_new_tokens=40), SpecConfig(k=16, max_new_tokens=50),
           SpecConfig(k=3, max_new_tokens=30, temperature=1.0, seed=3), SpecConfig(k=2, max_new_tokens=30, adaptive=True),
           SpecConfig(k=4, max_new_tokens=40, tree_nodes=12), SpecConfig(k=3, max_new_tokens=30, temperature=1.0, seed=3,
                                                                        tree_nodes=8)]


@pytest.fixture()
def fresh_pair():
    target, draft, tok = tiny_models(seed=7)
    pair = dataclasses.replace(make_pair("tiny", target, draft, tok, torch.device("cpu"), torch.float32), pass_costs=NOMINAL_COSTS)
    return dataclasses.replace(pair, eos_ids=frozenset())


def runs(pair):
    return [(generate(pair, "static caches", c).token_ids, generate(pair, "static caches", c, "autoregressive").token_ids)
            for c in CONFIGS]


@pytest.mark.parametrize("backend", [pytest.param("eager", marks=pytest.mark.slow), None])  # None: steps uncompiled
def test_static_caches_decode_the_same_tokens(fresh_pair, backend, request):
    if backend is None:
        request.getfixturevalue("uncompiled")
    before = runs(fresh_pair)
    fresh_pair = enable_graphs(fresh_pair, backend or "eager", max_len=256)
    if backend is None:
        fresh_pair.compiled["target"].compiled = fresh_pair.compiled["draft"].compiled = None
    assert runs(fresh_pair) == before
    assert fresh_pair.context_length == 256 - 32


def test_one_shape_gives_a_position_the_same_logits_in_a_step_and_in_a_chain_pass(fresh_pair, uncompiled):
    """A GPU's exactness, the CPU its stand-in: in float32 the CPU's products of one row and of eight sum in other
    orders, so a step's logits and a pass's part in their last bits; the target fed at one shape gives the same bits.
    Fed at each input's own padded size (one_shape=False), they part."""
    prompt, ids = list(range(3, 60)), torch.arange(100, 117)
    for one_shape in (True, False):
        fresh_pair = enable_graphs(fresh_pair, "eager", max_len=256, one_shape=one_shape)
        lm = fresh_pair.cached("target")
        lm.prefill(prompt)
        alone = torch.stack([lm.forward(ids[i: i + 1], keep=1)[0] for i in range(len(ids))])
        lm.crop(len(prompt))
        assert torch.equal(lm.forward(ids, keep=len(ids)), alone) == one_shape
        assert (fresh_pair.compiled["target"].width == 32) == one_shape
    fresh_pair = enable_graphs(fresh_pair, "eager", max_len=256)
    cfg = SpecConfig(k=8, max_new_tokens=40)
    assert generate(fresh_pair, "one shape", cfg).token_ids == generate(fresh_pair, "one shape", cfg, "autoregressive").token_ids


def test_interleaved_decoders_get_their_own_cache(fresh_pair, uncompiled):
    cfg = SpecConfig(k=4, max_new_tokens=30)
    alone = [generate(fresh_pair, "race", cfg, m).token_ids for m in ("speculative", "autoregressive")]
    fresh_pair = enable_graphs(fresh_pair, "eager", max_len=256)
    streams = {0: speculative_generate(fresh_pair, "race", cfg), 1: autoregressive_generate(fresh_pair, "race", cfg)}
    ids = [[], []]
    while streams:  # the app's race: one round of each in turn, on one target
        for i, stream in list(streams.items()):
            event = next(stream, None)
            if event is None:
                del streams[i]
            else:
                ids[i].extend(event.committed)
    assert ids == alone
    assert len(fresh_pair.compiled["target"].free) == 2  # both caches back in the pool, none leaked


def test_a_failing_compiled_step_falls_back_without_changing_output(fresh_pair, uncompiled):
    cfg = SpecConfig(k=4, max_new_tokens=30)
    before = generate(fresh_pair, "fallback", cfg).token_ids
    fresh_pair = enable_graphs(fresh_pair, "eager", max_len=256)

    def broken(**kwargs):
        raise RuntimeError("no compiler here")

    for role in ("target", "draft"):
        fresh_pair.compiled[role].compiled = broken
    with pytest.warns(UserWarning, match="uncompiled"):
        assert generate(fresh_pair, "fallback", cfg).token_ids == before


def test_a_default_run_uses_only_the_sizes_compiled_at_load(fresh_pair, monkeypatch):
    """On a GPU a size first met mid-run compiles there (a 7B-shaped target: minutes of a race): enable_graphs warms
    every padded size a default round feeds each model, a draft step's guesses included."""
    fed = {}

    def recording(fn, **options):
        def step(**kwargs):
            fed.setdefault(fn.__self__, set()).add(kwargs["input_ids"].shape[1])
            return fn(**kwargs)
        return step

    monkeypatch.setattr(torch, "compile", recording)
    fresh_pair = enable_graphs(fresh_pair, "eager", max_len=512)
    warmed = {model: set(sizes) for model, sizes in fed.items()}
    fed.clear()
    prompt = "a b c a b c a b c a b c"  # repeats, so that the draft's steps carry guesses
    generate(fresh_pair, prompt, SpecConfig(max_new_tokens=60))
    generate(fresh_pair, prompt, SpecConfig(max_new_tokens=60, min_confidence=0.0))
    assert fed[fresh_pair.draft] - {1, 2}, "no draft step carried a guess: the test did not run its case"
    for model, sizes in fed.items():
        assert sizes <= warmed[model], (model.__class__.__name__, sorted(sizes - warmed[model]))


@pytest.mark.slow  # static caches through dynamo (seconds of tracing)
def test_static_cache_refuses_to_overflow(fresh_pair):
    fresh_pair = enable_graphs(fresh_pair, "eager", max_len=96)
    lm = fresh_pair.cached("target")
    lm.prefill(list(range(1, 60)))
    with pytest.raises(ValueError, match="static cache of 96"):
        lm.forward(torch.ones(8, dtype=torch.long), keep=1)


def test_the_chat_template_head_is_computed_once_and_copied(fresh_pair):
    from specdec_core.text import encode_prompt

    head = fresh_pair.heads["target"].ids
    ids = encode_prompt(fresh_pair.tokenizer, "shared heads")
    assert len(head) > 1 and ids[: len(head)] == head
    fed = []
    hook = fresh_pair.target.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]),
                                                       with_kwargs=True)
    try:
        first, second = fresh_pair.cached("target"), fresh_pair.cached("target")
        first.prefill(ids[:-1])
        second.prefill(ids[:-1])
    finally:
        hook.remove()
    assert fed == [len(head), len(ids) - 1 - len(head), len(ids) - 1 - len(head)]  # the head ran once
    whole = CachedModel(fresh_pair.target, fresh_pair.vocab)
    whole.forward(torch.tensor(ids[:-1]), keep=1, prompt=True)  # no head sharing: one pass over the prompt
    last = torch.tensor(ids[-1:])
    for cached in (first, second):
        assert cached.length == whole.length
        torch.testing.assert_close(cached.forward(last, keep=1), whole.forward(last, keep=1))
        whole.crop(len(ids) - 1)
    # a prompt without the head (no chat template) is prefilled as it is
    plain = fresh_pair.cached("target")
    plain.prefill([5, 6, 7])
    assert plain.length == 3


def test_a_long_prompt_runs_in_chunks(fresh_pair, monkeypatch):
    """A prompt longer than PROMPT_CHUNK tokens runs in passes of at most that many, after the shared head, and leaves
    the cache and the next logits as one pass over it would; speculative and plain decoding prefill alike."""
    from specdec_core import cache
    from specdec_core.text import encode_prompt

    monkeypatch.setattr(cache, "PROMPT_CHUNK", 8)
    text, fed = "a prompt of some length, longer than a chunk", []
    hook = fresh_pair.target.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]),
                                                       with_kwargs=True)
    try:
        ids = list(range(3, 23))  # 20 tokens, no head
        chunked = CachedModel(fresh_pair.target, fresh_pair.vocab)
        chunked.prefill(ids)
        assert fed == [8, 8, 4] and chunked.length == 20
        chunked.check()
        whole = CachedModel(fresh_pair.target, fresh_pair.vocab)
        whole.forward(torch.tensor(ids), keep=1, prompt=True)
        torch.testing.assert_close(chunked.forward(torch.tensor([30, 31]), keep=2), whole.forward(torch.tensor([30, 31]), keep=2))
        head = fresh_pair.heads["target"].ids
        prompt = encode_prompt(fresh_pair.tokenizer, text)
        fed.clear()
        fresh_pair.cached("target").prefill(prompt)
        rest = len(prompt) - len(head)
        assert rest > 8 and fed == [len(head)] + [8] * (rest // 8) + ([rest % 8] if rest % 8 else [])
    finally:
        hook.remove()
    # the exact target: greedy speculative decoding is plain decoding's, the prompts read in chunks by both
    exact = dataclasses.replace(fresh_pair, target=quantise_target(copy.deepcopy(fresh_pair.target)), heads={})
    prompts, forward = [], CachedModel.forward
    monkeypatch.setattr(CachedModel, "forward", lambda self, ids, keep, **kw: (
        prompts.append(ids.numel()) if kw.get("prompt") and self.model is exact.target else None) or forward(self, ids, keep, **kw))
    for cfg in (CONFIGS[1], CONFIGS[4]):  # a chain and a tree
        assert generate(exact, text, cfg).token_ids == generate(exact, text, cfg, "autoregressive").token_ids
    n = len(encode_prompt(exact.tokenizer, text)) - 1  # the engine's prefill: all but the last prompt token
    assert n > 8 and prompts == ([8] * (n // 8) + ([n % 8] if n % 8 else [])) * 4  # the same chunks in each run


@pytest.mark.slow  # whole runs of both attentions; the fast tier's is test_load's draft on grouped attention
def test_grouped_attention_decodes_what_sdpa_decodes(fresh_pair):
    """Key/value heads read as they are (never repeated per query head) give the same logits and tokens,
    in prompts (no mask: causal), single steps and verification passes."""
    assert fresh_pair.target.config.num_attention_heads > fresh_pair.target.config.num_key_value_heads
    cfg = SpecConfig(k=4, max_new_tokens=40)
    before = runs(fresh_pair)
    lm = fresh_pair.cached("target")
    lm.prefill(list(range(3, 40)))
    sdpa = lm.forward(torch.arange(50, 57), keep=7)
    for model in (fresh_pair.target, fresh_pair.draft):
        model.set_attn_implementation(GROUPED)
    lm = fresh_pair.cached("target")
    lm.prefill(list(range(3, 40)))
    torch.testing.assert_close(lm.forward(torch.arange(50, 57), keep=7), sdpa)
    assert runs(fresh_pair) == before and generate(fresh_pair, "grouped", cfg).token_ids


def test_a_growing_cache_writes_in_place_and_keeps_what_concatenation_keeps(fresh_pair):
    """RoomLayer: the logits of transformers' concatenating cache, through steps, passes, crops and tree compaction;
    a step writes into the buffer it already has (no copy of the cache)."""
    from transformers import DynamicCache

    from specdec_core.cache import RoomLayer, TreeInput

    ours, theirs = fresh_pair.cached("target"), fresh_pair.cached("target")
    theirs.cache = DynamicCache(config=fresh_pair.target.config)
    assert all(type(layer) is RoomLayer for layer in ours.cache.layers)
    for lm in (ours, theirs):
        lm.prefill(list(range(3, 40)))
    buffers = set()
    for i in range(12):
        ids = torch.arange(50 + i, 52 + i) if i % 3 else torch.tensor([60 + i])
        torch.testing.assert_close(ours.forward(ids, keep=len(ids)), theirs.forward(ids, keep=len(ids)), rtol=0, atol=0)
        buffers.add(ours.cache.layers[0].keys.data_ptr())
        if i % 4 == 1:
            for lm in (ours, theirs):
                lm.forward(torch.tensor([9, 10, 11]), keep=3, tree=TreeInput([-1, -1, 0]))
                lm.compact(lm.length - 3, [1])
        if i % 5 == 2:
            for lm in (ours, theirs):
                lm.crop(lm.length - 2)
        assert int(ours.cache.get_seq_length()) == ours.length == theirs.length
    assert len(buffers) == 1  # 37 + at most 24 + 12 tokens fit in the first buffer's room: never reallocated
    layer = RoomLayer()
    keys, _ = layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    more, _ = layer.update(torch.randn(1, 2, 400, 8), torch.randn(1, 2, 400, 8))  # past the room: a larger buffer
    assert more.shape == (1, 2, 403, 8) and torch.equal(more[:, :, :3], keys)
