"""The written-out forwards (models/step.py, step_ops.c): their small operations against PyTorch, and the draft's
step against the general forward."""
import copy

import pytest
import torch
import torch.nn.functional as F

from specdec_core.cache import CachedModel, TreeInput
from specdec_core.models import quant
from specdec_core.models import step as step_module
from specdec_core.models.int8 import TokenInt8Linear
from specdec_core.models.kernels import native, step_ops
from specdec_core.models.quant import draft_to_int4
from specdec_core.models.step import DraftStep


@pytest.mark.parametrize("suffix, bf", [("", torch.bfloat16), ("_f32", torch.float32)])  # the draft's set, the target's
def test_the_written_forwards_small_operations_are_pytorchs_up_to_rounding(suffix, bf):
    """step_ops.c against the PyTorch it replaces: each result within one rounding of PyTorch's in float32 (bfloat16's
    for the draft's set; float32's, and the activation's polynomial, for the target's)."""
    lib = step_module.ops()
    if lib is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    add_norm, silu_mul, rotate_write = (getattr(lib, name + suffix) for name in ("add_norm", "silu_mul", "rotate_write"))
    g = torch.Generator().manual_seed(0)
    rtol = 2 ** -7 if bf == torch.bfloat16 else 1e-5
    close = lambda mine, ref: torch.allclose(mine.float(), ref, rtol=rtol, atol=1e-6)
    n, dim, inter = 3, 96, 160
    h = torch.randn(n, dim, generator=g) * 3
    add, weight = (torch.randn(n, dim, generator=g) * 5).to(bf), (torch.rand(dim, generator=g) + 0.5).to(bf)
    out, summed = torch.empty(n, dim, dtype=bf), h + add.float()
    add_norm(h.data_ptr(), add.data_ptr(), weight.data_ptr(), n, dim, 1e-6, out.data_ptr())
    assert torch.allclose(h, summed) and close(out, F.rms_norm(summed, (dim,), weight.float(), 1e-6))
    add_norm(h.data_ptr(), None, weight.data_ptr(), n, dim, 1e-6, out.data_ptr())  # nothing to add
    assert torch.allclose(h, summed) and close(out, F.rms_norm(summed, (dim,), weight.float(), 1e-6))
    # silu over the range where its exponential matters, and far out on both sides
    gate_up = torch.cat([torch.linspace(-30, 30, n * inter).view(n, inter), torch.randn(n, inter, generator=g)], 1).to(bf)
    act = torch.empty(n, inter, dtype=bf)
    silu_mul(gate_up.data_ptr(), n, inter, act.data_ptr())
    gate, up = gate_up.float().chunk(2, -1)
    assert close(act, F.silu(gate) * up)
    # two heads of queries and one of keys and values, rotated by positions 5, 6, 7 into a cache holding 5 of 9
    heads, kv, d, room, length = 2, 1, 8, 9, 5
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g).to(bf)
    angle = torch.arange(length, length + n)[:, None] * (10000 ** -(torch.arange(d // 2) / (d // 2)))
    cos, sin = torch.cat([angle.cos()] * 2, -1).contiguous(), torch.cat([angle.sin()] * 2, -1).contiguous()
    q, keys, values = torch.empty(heads, n, d, dtype=bf), torch.zeros(kv, room, d, dtype=bf), torch.zeros(kv, room, d, dtype=bf)
    rotate_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, heads, kv, d, q.data_ptr(), keys.data_ptr(),
                     values.data_ptr(), room, length)
    x = qkv.float().view(n, heads + 2 * kv, d).transpose(0, 1)
    rotated = x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin
    assert close(q, rotated[:heads]) and close(keys[:, length:length + n], rotated[heads:heads + kv])
    assert torch.equal(values[:, length:length + n], qkv.view(n, -1, d).transpose(0, 1)[heads + kv:])
    assert not keys[:, :length].any() and not keys[:, length + n:].any()  # nothing written outside its rows


@pytest.mark.parametrize("heads, kv, d", [(4, 2, 16), (14, 2, 64), (6, 3, 48)])
def test_the_drafts_attention_is_pytorchs_up_to_rounding(heads, kv, d):
    """step_ops.c's attention for the draft's steps against PyTorch's, causal over a cache: one row and several, each
    row seeing the cache and the rows before it and nothing after."""
    lib = step_module.ops()
    if lib is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    g = torch.Generator().manual_seed(1)
    for length, n in ((0, 1), (5, 1), (37, 3), (200, 4)):
        room = length + n + 7
        q = torch.randn(heads, n, d, generator=g).to(torch.bfloat16)
        keys = (torch.randn(kv, room, d, generator=g) * 2).to(torch.bfloat16)
        values = torch.randn(kv, room, d, generator=g).to(torch.bfloat16)
        out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
        assert lib.grouped_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), n, heads, kv, d, room, length,
                                     d ** -0.5, out.data_ptr(), 2) == 0
        seen = torch.ones(n, length + n, dtype=torch.bool).tril(length)
        ref = F.scaled_dot_product_attention(q.float()[None], keys.float()[None, :, : length + n],
                                             values.float()[None, :, : length + n], attn_mask=seen, enable_gqa=True)
        assert torch.allclose(out.float(), ref[0].transpose(0, 1), rtol=2 ** -7, atol=2e-3), (length, n)


def small_operations(lib, seed: int = 0) -> list[torch.Tensor]:
    """Every output of step_ops.c's functions on rows of a model's widths and of an odd one, with activations across
    the exponential's whole range; the draft's attention over those rows and four before them."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for suffix, dtype in (("", torch.bfloat16), ("_f32", torch.float32)):
        add_norm, silu_mul, rotate_write = (getattr(lib, name + suffix) for name in ("add_norm", "silu_mul", "rotate_write"))
        for n, dim, inter in ((5, 1536, 8960), (3, 100, 37)):
            h, add = torch.randn(n, dim, generator=g) * 3, (torch.randn(n, dim, generator=g) * 5).to(dtype)
            weight, out = (torch.rand(dim, generator=g) + 0.5).to(dtype), torch.empty(n, dim, dtype=dtype)
            add_norm(h.data_ptr(), add.data_ptr(), weight.data_ptr(), n, dim, 1e-6, out.data_ptr())
            gate_up = (torch.randn(n, 2 * inter, generator=g) * 40).to(dtype)
            act = torch.empty(n, inter, dtype=dtype)
            silu_mul(gate_up.data_ptr(), n, inter, act.data_ptr())
            heads, kv, d, room = 12, 2, 128, n + 4
            qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g).to(dtype)
            cos, sin = torch.rand(n, d, generator=g), torch.rand(n, d, generator=g)
            q, keys, values = torch.empty(heads, n, d, dtype=dtype), *torch.zeros(2, kv, room, d, dtype=dtype)
            rotate_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, heads, kv, d, q.data_ptr(), keys.data_ptr(),
                         values.data_ptr(), room, 4)
            outs += [h, out, act, q, keys, values]
            if dtype == torch.bfloat16:
                keys[:, :4], values[:, :4] = torch.randn(2, kv, 4, d, generator=g).to(dtype)
                attended = torch.empty(n, heads, d, dtype=dtype)
                lib.grouped_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), n, heads, kv, d, room, 4, d ** -0.5,
                                      attended.data_ptr(), 2)
                outs.append(attended)
    return outs


def test_every_build_of_the_small_operations_computes_the_same_bits(tmp_path):
    """The AVX-512 and AVX2 builds (where the CPU has them) and the one for any CPU: the same bits, so that a target's
    logits do not depend on which one ran. Built with contraction allowed, the AVX-512 build's differ: the check can see
    it."""
    if not native.AVX512_VNNI | native.AVX2 <= native.cpu_flags():
        pytest.skip("this CPU has no AVX-512 (VNNI) and AVX2 to build step_ops.c for")

    def built(flags):
        lib, why = native.build(step_ops.SOURCE, flags, tmp_path)
        assert lib is not None, why
        return small_operations(step_ops.bind(lib))

    wide = step_ops.FLAGS + native.AVX512_VNNI_FLAGS
    anywhere, avx512, avx2 = built(step_ops.FLAGS), built(wide), built(step_ops.FLAGS + native.AVX2_FLAGS)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(anywhere, avx512, avx2, strict=True))
    fused = built([f for f in wide if f != "-ffp-contract=off"] + ["-ffp-contract=fast"])
    assert not all(torch.equal(a, b) for a, b in zip(anywhere, fused, strict=True))


def test_where_the_draft_steps_operations_cannot_be_built_the_draft_takes_the_general_forward(tiny, monkeypatch, tmp_path):
    draft = draft_to_int4(copy.deepcopy(tiny.draft).to(torch.bfloat16))  # its int4 product built as it is
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    step_module.ops.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert not DraftStep.fits(draft)
        monkeypatch.delenv("CC")
        step_module.ops.cache_clear()
        assert DraftStep.fits(draft)  # built with the real compiler
    finally:
        step_module.ops.cache_clear()


def biased_int4_draft(tiny):
    """The tiny draft in int4, bfloat16, its q/k/v biases as a trained Qwen2's: not zero (a fresh one's are)."""
    draft = copy.deepcopy(tiny.draft).to(torch.bfloat16)
    for attention in (layer.self_attn for layer in draft.model.layers):
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            torch.nn.init.normal_(projection.bias, std=0.5, generator=torch.Generator().manual_seed(2))
    return draft_to_int4(draft)


def test_the_written_out_draft_step_follows_the_general_forward(tiny, monkeypatch):
    """The draft's decoding step on CPUs (models/step.py) against transformers' forward of the same int4 model:
    the same numbers up to bfloat16 rounding, whether the cache was last grown by a step, a prompt or the general
    forward (a tree level), cropped after a rejection or compacted onto a tree's path; with step_ops.c's attention
    up to OWN_ATTENTION_MOST positions (50 here) and PyTorch's beyond, and biases added in the int4 product."""
    if step_module.ops() is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    monkeypatch.setattr(step_module, "OWN_ATTENTION_MOST", 50)
    draft = biased_int4_draft(tiny)
    assert DraftStep.fits(draft) and not DraftStep.fits(tiny.draft)  # float32 projections: the general forward
    step, taken = DraftStep(draft), []

    def spy(ids, cache, length, keep, tree=None, prompt=False, skip=None):
        logits = step(ids, cache, length, keep, tree, prompt, skip)
        taken.append((ids.shape[1], tree is not None, logits is not None))
        return logits
    fast, general = CachedModel(draft, tiny.vocab, written=spy), CachedModel(draft, tiny.vocab)
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    fast.prefill(prompt), general.prefill(prompt)
    assert taken == [(40, False, True)]  # a prompt is written out too (the next test compares it)
    worst, scale = 0.0, 0.0
    for i in range(30):
        n = 2 if i % 5 == 0 else 1
        ids = torch.tensor([(11 * i + j) % 250 + 3 for j in range(n)])
        mine, theirs = fast.forward(ids, keep=n), general.forward(ids, keep=n)
        worst, scale = max(worst, (mine.float() - theirs.float()).abs().max().item()), max(scale, theirs.abs().max().item())
        if i % 7 == 3:  # a rejection: back one token
            fast.crop(fast.length - 1), general.crop(general.length - 1)
        if i % 9 == 4:  # a tree level through the general forward, then its path kept
            for lm in (fast, general):
                lm.forward(torch.tensor([9, 10, 11]), keep=3, tree=TreeInput([-1, -1, 0]))
                lm.compact(lm.length - 3, [0, 2])
        assert fast.length == general.length and int(fast.cache.get_seq_length()) == fast.length
    steps = [n for n, tree, took in taken if not tree]
    assert steps.count(1) > 15 and steps.count(2) == 6  # one and two tokens a step, all taken; trees not
    assert all(took != tree for n, tree, took in taken)
    assert worst < 0.05 * scale, (worst, scale)  # rounding at most, not another function
    assert {attention for _, attention in step.plans} == {"grouped", "sdpa"}
    # PyTorch's 64-row blocks: gate and up (128 rows each) are one product; k and v (32 rows) would shift q's blocks.
    # Ours takes blocks of 4 rows: q/k/v are one product too
    own = quant.int4_kernel() == "vnni"
    assert [step.layers[0][i].fused for i in (1, 4)] == [own, True]


def test_the_draft_reads_a_prompt_written_out_as_the_general_forward_does(tiny, monkeypatch):
    """A short prompt's rows through the draft's written forward, against transformers' forward of the same int4
    model, every row's logits: from Int4Linear.WIDE rows on the int8 twins' products (as Int4Linear.forward takes
    them), fewer on int4; each row sees the cache and the rows before it, with step_ops.c's attention up to
    OWN_ATTENTION_MOST positions (50 here) and PyTorch's beyond; more than DRAFT_ROWS_MOST rows (20 here) take the
    general forward; then a step on the cache they wrote."""
    if step_module.ops() is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    monkeypatch.setattr(step_module, "OWN_ATTENTION_MOST", 50)
    monkeypatch.setattr(step_module, "DRAFT_ROWS_MOST", 20)
    draft = biased_int4_draft(tiny)
    step, taken, twins = DraftStep(draft), [], []

    def spy(*args):
        logits = step(*args)
        taken.append(logits is not None)
        return logits
    fast, general = CachedModel(draft, tiny.vocab, written=spy), CachedModel(draft, tiny.vocab)
    forward, twin = TokenInt8Linear.forward, {id(m.wide) for m in draft.modules() if getattr(m, "wide", None)}
    monkeypatch.setattr(TokenInt8Linear, "forward", lambda self, x: (id(self) in twin and twins.append(x.shape[-2])) or
                        forward(self, x))  # the tiny head's int8 layer is no twin
    # 12 rows from 0, 5 from 12, 30 from 17 (the general forward), 8 from 47: past 50 positions, PyTorch's attention
    for n, twinned, written in ((12, True, True), (5, False, True), (30, True, False), (8, True, True)):
        ids = torch.tensor([(13 * n + 7 * i) % 250 + 3 for i in range(n)])
        twins.clear()
        mine = fast.forward(ids, keep=n, prompt=True)
        assert taken[-1] == written and bool(twins) == twinned and set(twins) <= {n}, (n, twins)
        theirs = general.forward(ids, keep=n, prompt=True)
        # rounding at most (the general forward's residual stream is bfloat16, ours float32): up to 0.06 of the
        # largest logit here, where a prompt's row that sees the rows after it is off by half of it
        assert (mine.float() - theirs.float()).abs().max() < 0.1 * theirs.abs().max(), n
        assert fast.length == general.length and int(fast.cache.get_seq_length()) == fast.length
    ids = torch.tensor([42])
    mine, theirs = fast.forward(ids, keep=1), general.forward(ids, keep=1)
    assert taken[-1] and (mine.float() - theirs.float()).abs().max() < 0.1 * theirs.abs().max()
    assert {attention for _, attention in step.plans} == {"grouped", "sdpa"}
