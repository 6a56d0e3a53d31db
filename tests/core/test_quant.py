"""A cheaper draft (int4 or int8 weights, pruned head) changes acceptance only, never the output; an int8
target is another target, but one function of its input: a position's logits do not depend on the pass."""
import copy
import dataclasses
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from specdec_core import SpecConfig, generate
from specdec_core.cache import CachedModel, TreeInput
from specdec_core.models import int4_vnni, int8, int8_vnni, native, quant
from specdec_core.models import step as step_module
from specdec_core.models.quant import (
    DynamicInt8Linear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    PrunedHead,
    can_pack,
    cheapen_draft,
    pack_linears,
    quantise_target,
    replace_linears,
)
from specdec_core.models.int8 import TokenInt8Linear
from specdec_core.models.step import DecodeStep

from ..conftest import with_eos


def test_int8_linear_is_close_to_the_original():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    q = Int8Linear(lin)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (32,)
    err = (q(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert 0 < err < 0.02


def test_int8_weights_are_torchs_per_channel_quantisation():
    """int8_weights rounds each weight times its row's inverse scale, half to even: torch.quantize_per_channel's
    numbers, five times faster (the int8 target and the draft's twins are made from them at a first start). Ties are
    built exactly; the random rows are many, since dividing by the scale instead differs in a few in a million."""
    import warnings

    torch.manual_seed(0)
    w = torch.randn(4864, 896) * torch.rand(4864, 1) * 0.05
    w[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5]) * 2 ** -10  # the row's scale is 2^-10: exact ties
    lin = torch.nn.Linear(896, 4864, bias=False)
    lin.weight.data = w
    qweight, scale = int8.int8_weights(lin, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8).int_repr()
    assert qweight.dtype == torch.int8 and torch.equal(qweight, want)
    assert qweight[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


INT4_KERNELS = ("torch", "vnni")  # Int4Linear's: ours where it runs, else PyTorch's


@pytest.fixture(params=INT4_KERNELS)
def int4_kernel(request):
    if request.param == "vnni" and int4_vnni.library()[0] is None:
        pytest.skip(f"the int4 kernel of our own cannot run here: {int4_vnni.library()[1]}")
    return request.param


def test_int4_linear_is_close_and_exact_on_4bit_blocks(int4_kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    q = Int4Linear(lin, kernel=int4_kernel)
    if int4_kernel == "torch":
        assert q.packed.dtype == torch.uint8 and q.scales.shape == (2, 32, 2)  # [in / 32, out, scale and zero]
    else:
        assert q.tiles.shape == (8, 1, 320) and q.packed is None  # 4 outputs and 128 inputs (64, padded) a tile
    err = (q(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert 0 < err < 0.1
    # weights that already sit on 16 levels per block of 32 (as GGUF's Q4_K blocks do) are kept exactly; ours
    # rounds the activations to int8 per block of 32 as well
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every block spans all 16 levels
    step, low = (torch.rand(32, 2, 1) * 0.1 + 0.01).half().float(), torch.randn(32, 2, 1).half().float()
    lin.weight.data = (levels.view(32, 2, 32) * step + low).view(32, 64)
    x = x.bfloat16().float()
    if int4_kernel == "torch":
        torch.testing.assert_close(Int4Linear(lin, kernel=int4_kernel)(x), lin(x), rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(Int4Linear(lin, kernel=int4_kernel)(x), int4_reference(lin, x), rtol=1e-2, atol=1e-3)


def int4_reference(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What int4_vnni.c computes from weights on 16 levels a block, in PyTorch: each row rounded to int8 per block
    of 32 inputs against the block's largest magnitude (in float32), then multiplied by the weights in float64."""
    blocks = x.float().view(len(x), -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, 0.0)  # in float32, as the kernel rounds
    rounded = (torch.round(blocks * inv).double() * (top / 127).double()).view_as(x)
    bias = 0 if lin.bias is None else lin.bias.double()
    return (rounded @ lin.weight.double().T + bias).detach().bfloat16().float()


def test_the_int4_vnni_product_is_the_reference_arithmetic_for_any_number_of_rows():
    """Padded shapes (outputs not a multiple of 4, inputs not of 128) and up to 17 rows, against the reference: every
    row also alone, with the same bits (the draft's guesses and tree levels come in passes of several rows)."""
    if int4_vnni.library()[0] is None:
        pytest.skip(f"the int4 kernel of our own cannot run here: {int4_vnni.library()[1]}")
    g = torch.Generator().manual_seed(1)
    for n, k in ((36, 96), (259, 160), (64, 896)):
        levels = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
        levels[..., 0], levels[..., 1] = 0, 15  # every block spans all 16 levels: quantised again, it stays
        step = (torch.rand(n, k // 32, 1, generator=g) * 0.1 + 0.01).half().double()
        low = torch.randn(n, k // 32, 1, generator=g).half().double()
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = (levels * step + low).view(n, k).float()
        q = Int4Linear(lin, kernel="vnni")
        for rows in (1, 2, 5, 8, 9, 17):
            x = torch.randn(rows, k, generator=g).bfloat16()
            x[0, :32] = 0  # a block of zeros
            with torch.no_grad():
                y = q(x)
            assert y.dtype == torch.bfloat16
            ref, size = int4_reference(lin, x.float()), x.float().abs() @ lin.weight.abs().T  # size: no cancellation
            assert ((y.float() - ref).abs() <= 8e-3 * ref.abs() + 1e-3 * size).all()  # bfloat16 out, float32 sums
            assert torch.equal(y, torch.cat([q(x[i: i + 1]) for i in range(rows)]))


def test_int4_mode_falls_back_to_mixed_int8_where_the_kernel_does_not_fit(tiny):
    draft = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16))
    assert isinstance(draft.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(draft.model.layers[0].self_attn.k_proj, Int4Linear)
    assert isinstance(draft.lm_head, DynamicInt8Linear)  # 259 rows: the int4 kernel wants a multiple of 16
    fp32 = cheapen_draft(copy.deepcopy(tiny.draft).float())  # the int4 kernel is slow with float32: as "mixed"
    assert type(fp32.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(fp32.model.layers[0].mlp.up_proj, DynamicInt8Linear)
    with torch.inference_mode():
        out = draft(torch.tensor([[5, 9, 33]])).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_pruned_head_masks_the_tail():
    head = torch.nn.Linear(8, 10, bias=False)
    pruned = PrunedHead(head, keep=6, vocab=10)
    out = pruned(torch.randn(2, 8))
    assert out.shape == (2, 10) and torch.isinf(out[:, 6:]).all() and torch.isfinite(out[:, :6]).all()
    assert pruned.weight.shape[0] == 10


def test_cheapened_draft_stays_lossless(tiny):
    pair = with_eos(tiny, [])
    cheap = dataclasses.replace(pair, draft=cheapen_draft(copy.deepcopy(pair.draft), keep_vocab=128))
    cfg = SpecConfig(k=4, max_new_tokens=40)
    out = generate(cheap, "hello there", cfg)
    assert out.token_ids == generate(pair, "hello there", cfg, "autoregressive").token_ids
    assert all(t < 128 for e in out.events for t in e.drafted)  # the pruned head never proposes the tail
    sampled = generate(cheap, "hello there", SpecConfig(k=4, max_new_tokens=40, temperature=1.0, seed=3))
    assert len(sampled.token_ids) == 40


def test_packed_linears_give_the_same_logits(tiny):
    model = copy.deepcopy(tiny.target).to(torch.bfloat16)
    if not can_pack(model):
        pytest.fail("oneDNN is not available in this torch build")
    ids = torch.tensor([[5, 9, 33, 101, 7]])
    with torch.inference_mode():
        before = model(ids).logits
        pack_linears(model)
        after = model(ids).logits
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_the_mixed_int8_draft_keeps_down_proj_weight_only(tiny):
    draft = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16), mode="mixed")
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in draft.named_modules()
             if isinstance(m, (Int8Linear, DynamicInt8Linear))}
    assert kinds["down_proj"] is Int8Linear and kinds["gate_proj"] is DynamicInt8Linear
    assert kinds["lm_head"] is DynamicInt8Linear
    fp32 = cheapen_draft(copy.deepcopy(tiny.draft).float(), mode="mixed")  # the weight-only kernel is slow in float32
    assert type(fp32.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(fp32.model.layers[0].mlp.up_proj, DynamicInt8Linear)
    with pytest.raises(ValueError, match="one of int4, mixed"):  # the int8-everywhere variants are gone
        cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16), mode="dynamic")
    with torch.inference_mode():
        out = draft(torch.tensor([[5, 9, 33]])).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int4", "mixed"])
def test_saved_draft_is_the_same_draft_and_stale_files_are_rebuilt(tiny, tmp_path, dtype, mode):
    x = torch.tensor([[5, 17, 42, 99, 7, 8, 9, 10, 11, 12]])  # 10 rows: int4 layers take their int8 twin
    path = tmp_path / f"draft-{mode}.safetensors"
    fresh = cheapen_draft(copy.deepcopy(tiny.draft).to(dtype), mode=mode, saved=path, source="weights v1")
    assert path.exists()
    for damage in (None, "other source", "other mode", "corrupt"):
        if damage == "corrupt":
            path.write_bytes(b"not a safetensors file")
        if damage == "other mode":  # a file of the other mode under this name is rebuilt, not misread
            cheapen_draft(copy.deepcopy(tiny.draft).to(dtype), mode="int4" if mode == "mixed" else "mixed", saved=path,
                          source="weights v1")
        reloaded = cheapen_draft(copy.deepcopy(tiny.draft).to(dtype), mode=mode, saved=path,
                                 source="weights v2" if damage == "other source" else "weights v1")
        with torch.inference_mode():
            assert torch.equal(fresh(x).logits, reloaded(x).logits)
    with safe_open(str(path), "pt") as f:  # the last load rewrote the file in this mode
        assert f.metadata()["source"].startswith(f"weights v1\n{mode}")
        twins = [key for key in f.keys() if "wide" in key]
    int4 = dtype == torch.bfloat16 and mode == "int4"
    assert bool(twins) == int4 and all(":wide." in key for key in twins)  # saved once, with the int4 layer


def test_int4_products_of_many_rows_take_the_int8_twin():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    q = Int4Linear(lin, wide=True)
    assert Int4Linear(lin).wide is None
    for rows in (Int4Linear.WIDE - 1, Int4Linear.WIDE, 70):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        y = q(x)
        assert y.dtype == torch.bfloat16
        int4 = q.matmul(x) + q.bias
        assert torch.equal(y, int4) == (rows < Int4Linear.WIDE)  # a step's few rows stay int4
        if rows >= Int4Linear.WIDE:
            assert torch.equal(y, q.wide(x))
        assert ((y - lin(x)).float().abs().max() / lin(x).float().abs().max()) < 0.1


KERNELS = ("fbgemm", "onednn", "vnni")  # TokenInt8Linear's: oneDNN where the CPU has AMX, else ours, else fbgemm


@pytest.fixture(params=KERNELS)
def int8_kernel(request, monkeypatch):
    """Each int8 target test runs with each kernel as the default, whatever this CPU has (ours needs AVX-512 VNNI)."""
    if request.param == "vnni" and int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    monkeypatch.setattr(int8, "amx_int8", lambda: request.param == "onednn")
    monkeypatch.setattr(int8, "vnni_fits", lambda in_features: request.param == "vnni")
    return request.param


def vnni_reference(packed: int8_vnni.Int8Product, qweight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What int8_vnni.c computes, in PyTorch: each row rounded against its largest magnitude, exact integer sums,
    then the same float32 operations."""
    top = x.abs().amax(-1, keepdim=True)
    xq = torch.round(x * torch.where(top > 0, 127 / top, 0.0)).long()
    n = packed.out_features
    y = (xq @ qweight.long().T).float() * (packed.scale[:n] * (top / 127))
    return y if packed.bias is None else y + packed.bias[:n]


@pytest.mark.parametrize("n, k, bias", [(40, 96, True), (64, 36, False), (259, 64, True)])
def test_the_vnni_product_is_the_reference_arithmetic_for_any_number_of_rows(n, k, bias):
    """Every row count through its tiles of 1 to 6 rows, outputs padded to 32 (40, 259), an odd number of 4-input
    steps (36): the same bits as the reference, so a row's output cannot depend on the rows beside it."""
    if int8_vnni.library()[0] is None:
        pytest.skip(f"the int8 kernel of our own cannot run here: {int8_vnni.library()[1]}")
    torch.manual_seed(0)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, dtype=torch.float64) / 100
    packed = int8_vnni.Int8Product(qweight, scale, torch.randn(n) if bias else None)
    x = torch.randn(65, k) * torch.rand(65, 1) * 10
    x[3] = 0  # a row of zeros: its scale is 0, not a division by it
    want = vnni_reference(packed, qweight, x)
    for rows in (*range(1, 14), 17, 65):
        assert torch.equal(packed(x[:rows]), want[:rows]), rows
    assert torch.equal(want[3], packed.bias[:n] if bias else torch.zeros(n))


def test_token_int8_rows_do_not_depend_on_the_other_rows(int8_kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(17, 96) * torch.rand(17, 1) * 10  # rows of very different sizes
    with torch.no_grad():
        for layer, independent in ((TokenInt8Linear(lin), True), (DynamicInt8Linear(lin), False)):
            full = layer(x)
            alone = torch.cat([layer(x[i: i + 1]) for i in range(17)])
            assert torch.equal(full, alone) == independent, type(layer).__name__
            assert (full - lin(x)).abs().max() / lin(x).abs().max() < 0.03
        layer = TokenInt8Linear(lin)
        assert layer.kernel == int8_kernel
        # the kernels quantise the weights alike: a file saved with one serves the others
        other = TokenInt8Linear(lin, kernel="fbgemm" if int8_kernel != "fbgemm" else "onednn")
        assert all(torch.equal(layer.saved_state()[key], other.saved_state()[key]) for key in ("qweight", "scale"))


def test_where_ours_cannot_be_built_the_int8_target_keeps_fbgemm_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(int8_vnni.NEEDS))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(int8, "amx_int8", lambda: False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    lin, x = torch.nn.Linear(64, 32), torch.randn(5, 64)
    try:
        for cc, why in (("no-such-compiler", "no C compiler"), ("false", "building it failed")):
            monkeypatch.setenv("CC", cc)
            int8_vnni.library.cache_clear()
            with pytest.warns(RuntimeWarning, match=why):
                layer = TokenInt8Linear(lin)
            assert layer.kernel == "fbgemm" and int8_vnni.library()[1].startswith(why)
            with torch.no_grad():
                assert torch.equal(layer(x), torch.cat([layer(x[i: i + 1]) for i in range(5)]))
            assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
    finally:
        int8_vnni.library.cache_clear()


def test_the_int8_targets_product_can_be_picked_by_name():
    from specdec_core import load_pair

    kernels = lambda pair: {m.kernel for m in pair.target.modules() if isinstance(m, TokenInt8Linear)}
    pair = load_pair("tiny", target_quant="int8:fbgemm")
    assert kernels(pair) == {"fbgemm"} and pair.info.target_quant == "int8:fbgemm"
    runs_here = int8_vnni.NEEDS <= native.cpu_flags() and shutil.which(os.environ.get("CC", "gcc"))
    assert kernels(load_pair("tiny", target_quant="int8:vnni")) == ({"vnni"} if runs_here else {"fbgemm"})  # or falls back
    for bad in ("int8:fast", "off:vnni", "int4", "blocks:vnni"):
        with pytest.raises(ValueError, match="int8:KERNEL"):
            load_pair("tiny", target_quant=bad)
    with pytest.raises(ValueError, match="other pairs have none"):
        load_pair("tiny", target_quant="blocks")


def test_onednn_is_the_default_only_where_amx_tiles_are_there_and_not_capped(monkeypatch):
    """oneDNN's int8 products without AMX run a reference kernel hundreds of times slower than fbgemm's."""
    has_amx = bool(torch._C._cpu._get_cpu_capability().get("amx_int8")) and torch._C._cpu._init_amx()
    for cap, expected in ((None, has_amx), ("AVX512_CORE_AMX", has_amx), ("AVX512_CORE_VNNI", False)):
        if cap is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        int8.amx_int8.cache_clear()
        assert int8.amx_int8() == expected, cap
    int8.amx_int8.cache_clear()


def test_an_onednn_product_whose_rows_depend_on_their_number_leaves_the_layer_to_fbgemm(monkeypatch):
    """The probe (int8.onednn_rows_agree): where oneDNN's rows differ with the rows beside them (here a stand-in
    that adds a trace of the row count), the layer takes fbgemm, and stays exact."""
    real = torch.ops.onednn.qlinear_pointwise
    monkeypatch.setattr(int8, "_int8_agrees", {})
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", lambda q, *args: real(q, *args) * (1 + 1e-6 * len(q)))
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(64, 48), torch.randn(9, 64)
    with torch.no_grad():
        layer = TokenInt8Linear(lin, kernel="onednn")
        assert layer.kernel == "fbgemm" and int8._int8_agrees == {(64, 48): False}
        assert torch.equal(layer(x), torch.cat([layer(x[i: i + 1]) for i in range(9)]))
        monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", real)
        monkeypatch.setattr(int8, "_int8_agrees", {})
        assert TokenInt8Linear(lin, kernel="onednn").kernel == "onednn"


def logits_alone_and_in_a_pass(model, vocab, context: int = 57, step=None):
    """The logits of 17 positions fed one at a time, as plain decoding does, and the same positions inside one
    17-token chain pass; and, for a tree whose branch 0 -> 2 -> 5 -> ... holds those tokens among other nodes,
    that branch's rows of the tree pass, beside the same tokens fed alone. step: the model's written-out forward."""
    from specdec_core.cache import CachedModel, TreeInput

    prompt, pass_ids = [3 + i % 90 for i in range(context)], torch.arange(100, 117)
    lm = CachedModel(model, vocab, step=step)
    lm.prefill(prompt)
    full = lm.forward(pass_ids, keep=17)
    lm.crop(len(prompt))
    alone = torch.stack([lm.forward(pass_ids[i: i + 1], keep=1)[0] for i in range(17)])  # one at a time, as AR does
    # a tree: node i's parent is i - 2 (i >= 2), so 0 -> 2 -> 4 ... and 1 -> 3 -> 5 ... are two branches
    lm.crop(len(prompt))
    parents = [-1, -1] + list(range(15))
    tree = lm.forward(pass_ids, keep=17, tree=TreeInput(parents))
    lm.crop(len(prompt))
    branch = pass_ids[0::2]
    branch_alone = torch.stack([lm.forward(branch[i: i + 1], keep=1)[0] for i in range(len(branch))])
    return alone, full, tree[0::2], branch_alone


@pytest.mark.parametrize("context", [57, 300])
def test_the_int8_target_gives_a_position_the_same_logits_alone_or_in_a_pass(tiny, context, int8_kernel):
    target = quantise_target(copy.deepcopy(tiny.target).to(torch.bfloat16))
    assert next(target.parameters()).dtype == torch.float32
    assert {m.kernel for m in target.modules() if isinstance(m, TokenInt8Linear)} == {int8_kernel}
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(target, tiny.vocab, context)
    assert torch.equal(alone, full)
    assert torch.equal(tree, branch_alone)
    # the same layers with one activation scale for the whole pass give another function
    shared = replace_linears(copy.deepcopy(tiny.target), lambda name, mod: DynamicInt8Linear(mod))
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(shared, tiny.vocab, context)
    assert (alone - full).abs().max() > 1e-3 and (tree - branch_alone).abs().max() > 1e-3


def test_the_int8_target_is_exact_with_one_key_value_head(tiny):
    """With one key/value head (multi-query attention, as some Hub models have) each head's product is a batch of
    one, and MKL then sums a row differently with the number of rows beside it: batched, every row of a pass here
    differed from its step. The probe (attention.rows_agree) finds that, and each row gets a step's product."""
    from transformers import Qwen2ForCausalLM

    from specdec_core.models import attention
    from specdec_core.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(tiny.vocab, hidden=96, heads=6, kv_heads=1)
    target = quantise_target(Qwen2ForCausalLM(cfg).eval())
    alone, full, tree, branch_alone = logits_alone_and_in_a_pass(target, tiny.vocab)
    assert torch.equal(alone, full)
    assert torch.equal(tree, branch_alone)
    assert ("cpu", torch.float32, 1, 6, 16) in attention._agrees


def test_the_int8_target_reads_a_prompt_in_one_call_a_layer_and_a_pass_in_one_product_per_key_width(tiny, monkeypatch):
    """Both decoders compute a prompt alike, so it needs no step's arithmetic; every decoding position does: a pass's
    rows that read keys of one padded width share the kernel a step runs."""
    from specdec_core.models import attention

    target, calls = quantise_target(copy.deepcopy(tiny.target)), []
    sdpa, attend = torch.nn.functional.scaled_dot_product_attention, attention.attend
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kw: calls.append(("prompt", args[2].shape[2])) or sdpa(*args, **kw))
    monkeypatch.setattr(attention, "attend", lambda q, k, *a: calls.append((q.shape[1], k.shape[-2])) or attend(q, k, *a))
    lm, layers = CachedModel(target, tiny.vocab), target.config.num_hidden_layers
    lm.prefill(list(range(3, 203)))
    assert calls == [("prompt", 200)] * layers
    calls.clear()
    lm.forward(torch.arange(5, 22), keep=17)  # rows 201 to 217 keys wide: all padded to 256
    assert calls == [(17, 256)] * layers
    calls.clear()
    lm.forward(torch.arange(5, 6), keep=1)
    assert calls == [(1, 256)] * layers


@pytest.mark.parametrize("k", [1, 4, 16])
def test_the_int8_target_decodes_losslessly_and_is_saved(tiny, tmp_path, k, int8_kernel):
    path = tmp_path / "target-int8.safetensors"
    target = quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    again = quantise_target(copy.deepcopy(tiny.target), saved=path, source="weights v1")
    layers = [m for model in (target, again) for m in model.modules() if isinstance(m, TokenInt8Linear)]
    assert {m.kernel for m in layers} == {int8_kernel} and all(m.plain is None for m in layers)
    with torch.inference_mode():
        x = torch.tensor([[5, 17, 42, 99, 7]])
        assert torch.equal(target(x).logits, again(x).logits)
    pair = dataclasses.replace(with_eos(tiny, []), target=target, heads={})
    cfg = SpecConfig(k=k, max_new_tokens=48)
    spec = generate(pair, "int8 target", cfg)
    assert spec.token_ids == generate(pair, "int8 target", cfg, "autoregressive").token_ids
    assert 0 < spec.stats.acceptance_rate < 1


def test_compiled_steps_refuse_to_replace_the_exact_targets_attention():
    """Compiled steps set their own attention; over the int8 target that would lose exactness without a word."""
    from specdec_core import load_pair

    with pytest.raises(ValueError, match="exact"):
        load_pair("tiny", target_quant="int8", graphs="inductor")
    pair = load_pair("tiny", target_quant="int8")  # no compiled steps: the exact target as it is
    assert pair.target.config._attn_implementation == "specdec_rows" and not pair.compiled


def test_a_kernel_built_from_another_source_or_with_other_flags_leaves_the_other_builds(monkeypatch, tmp_path):
    """A cache may be shared by versions of the code and CPUs: a build never removes another build's file."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    source = tmp_path / "kernel.c"
    for version, flags in ((1, ["-O1"]), (2, ["-O1"]), (2, ["-O2"]), (1, ["-O1"])):
        source.write_text(f"int version(void) {{ return {version}; }}")
        lib, why = native.build(source, [*flags, "-shared", "-fPIC"])
        assert why == "" and lib.version() == version
    assert len(list((tmp_path / "kernels").glob("kernel-*.so"))) == 3


def test_where_the_int4_kernel_cannot_be_built_the_draft_keeps_pytorchs_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(int4_vnni.NEEDS))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    lin, x = torch.nn.Linear(64, 32).to(torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    int4_vnni.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="int4 draft's own product is not used: no C compiler"):
            layer = Int4Linear(lin)
        assert quant.int4_kernel() == "torch" and layer.tiles is None and layer.packed is not None
        with torch.no_grad():
            assert ((layer(x) - lin(x)).float().abs().max() / lin(x).float().abs().max()) < 0.1
    finally:
        int4_vnni.library.cache_clear()


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


def test_where_the_draft_steps_operations_cannot_be_built_the_draft_takes_the_general_forward(tiny, monkeypatch, tmp_path):
    draft = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16))  # its int4 product built as it is
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    step_module.ops.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert not DecodeStep.fits(draft)
        monkeypatch.delenv("CC")
        step_module.ops.cache_clear()
        assert DecodeStep.fits(draft)  # built with the real compiler
    finally:
        step_module.ops.cache_clear()


def test_the_written_out_draft_step_follows_the_general_forward(tiny):
    """The draft's decoding step on CPUs (models/step.py) against transformers' forward of the same int4 model:
    the same numbers up to bfloat16 rounding, whether the cache was last grown by a step or by the general forward
    (a prompt, a tree level), cropped after a rejection or compacted onto a tree's path."""
    if step_module.ops() is None:
        pytest.skip("step_ops.c cannot be built here (a warning said why)")
    draft = cheapen_draft(copy.deepcopy(tiny.draft).to(torch.bfloat16))
    assert DecodeStep.fits(draft) and not DecodeStep.fits(tiny.draft)  # float32 projections: the general forward
    step, taken = DecodeStep(draft), []

    def spy(ids, cache, length, keep, tree=None, prompt=False):
        logits = step(ids, cache, length, keep, tree, prompt)
        taken.append((ids.shape[1], tree is not None or prompt, logits is not None))
        return logits
    fast, general = CachedModel(draft, tiny.vocab, step=spy), CachedModel(draft, tiny.vocab)
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    fast.prefill(prompt), general.prefill(prompt)
    assert taken == [(40, True, False)]  # a prompt takes the general forward
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
    steps = [n for n, general_forward, took in taken if not general_forward]
    assert steps.count(1) > 15 and steps.count(2) == 6  # one and two tokens a step, all taken; prompts and trees not
    assert all(took != general_forward for n, general_forward, took in taken)
    assert worst < 0.05 * scale, (worst, scale)  # rounding at most, not another function
    # PyTorch's 64-row blocks: gate and up (128 rows each) are one product; k and v (32 rows) would shift q's blocks.
    # Ours takes blocks of 4 rows: q/k/v are one product too
    own = quant.int4_kernel() == "vnni"
    assert [step.layers[0][i].fused for i in (1, 4)] == [own, True]


def test_the_kernels_wrappers_refuse_rows_of_another_shape_or_type():
    """A ctypes call reads what it is given: rows of another width would be read past their end."""
    if int4_vnni.library()[0] is None or int8_vnni.library()[0] is None:
        pytest.skip("our int4 and int8 products cannot be built here")
    int4 = quant.Int4Linear(torch.nn.Linear(64, 32).bfloat16(), kernel="vnni")
    with pytest.raises(ValueError, match="bfloat16 rows of 64"):
        int4.matmul(torch.randn(2, 128).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 rows of 64"):
        int4_vnni.product(int4.tiles, torch.randn(2, 64), 32, 64)
    int8 = int8_vnni.Int8Product(torch.ones(32, 64, dtype=torch.int8), torch.ones(32, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="float32 rows of 64"):
        int8(torch.randn(2, 96))


def test_the_kernels_can_be_turned_off_and_the_fallbacks_run(monkeypatch, tmp_path):
    """SPECDEC_KERNELS=off: none of ours is built or loaded; the int8 target and the int4 draft keep PyTorch's."""
    from specdec_core.models import kquant

    monkeypatch.setenv("SPECDEC_KERNELS", "off")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    libraries = (int8_vnni.library, int4_vnni.library, kquant.library)
    for library in libraries:
        library.cache_clear()
    try:
        for library in libraries:
            assert library() == (None, "turned off by SPECDEC_KERNELS=off")
        assert not (tmp_path / "kernels").exists()
        assert int8.TokenInt8Linear(torch.nn.Linear(64, 32)).kernel in ("fbgemm", "onednn")
        assert quant.Int4Linear(torch.nn.Linear(64, 32).bfloat16()).tiles is None
    finally:
        for library in libraries:
            library.cache_clear()


TWO_STARTS = """
import sys, time
from pathlib import Path
import safetensors.torch
from specdec_core.models import quant
from specdec_core.models.tiny import tiny_models
save = quant.save_file
def slow_save(*args, **kwargs):  # widens the window between writing the file and moving it into place
    save(*args, **kwargs)
    time.sleep(1.0)
quant.save_file = slow_save
target, _, _ = tiny_models()
while time.time() < float(sys.argv[2]):  # both processes start at this second
    time.sleep(0.01)
quant.quantise_target(target, Path(sys.argv[1]), "tiny")
print("ok")
"""


@pytest.mark.slow  # two child processes, each loading torch
def test_two_starts_that_quantise_one_file_at_once_both_come_up(tmp_path):
    """Two apps started together on one empty cache: the second waits for the first's file and reads it."""
    import subprocess
    import sys
    import time

    saved, start = tmp_path / "target-int8.safetensors", f"{time.time() + 8:.2f}"
    runs = [subprocess.Popen([sys.executable, "-c", TWO_STARTS, str(saved), start], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=120) for run in runs]
    assert [out.strip() for out, _ in outs] == ["ok", "ok"], [err[-400:] for _, err in outs]
    assert saved.with_name(saved.name + ".sha256").read_text() == quant.file_digest(saved)  # whole, and checked
    assert not list(tmp_path.glob("*.partial"))
