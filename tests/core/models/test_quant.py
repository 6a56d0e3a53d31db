"""The draft's layers (int4, int8 where int4 does not fit, packed) and the weights kept in the cache (models/quant.py)."""
import copy
import dataclasses

import pytest
import torch
from safetensors import safe_open

from specdec_core import SpecConfig, generate
from specdec_core.models import quant
from specdec_core.models.kernels import int4_vnni, native
from specdec_core.models.int8 import TokenInt8Linear
from specdec_core.models.quant import Int4Linear, PackedLinear, can_pack, draft_to_int4, pack_linears

from ...conftest import with_eos


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


def test_the_avx2_build_of_the_int4_product_gives_the_avx512_builds_bits(tmp_path):
    """The draft's product on x86 CPUs without AVX-512 (most laptops): the same integers (vpmaddubsw's int16 pairs,
    summed while they cannot overflow) and float operations, so the same bits, also where every weight is 15 and every
    activation rounds to +-127, the largest sums a narrower partial sum must hold."""
    if not native.AVX512_VNNI | native.AVX2 <= native.cpu_flags():
        pytest.skip("this CPU cannot run both builds")
    libs = []
    for build in ("avx512-vnni", "avx2"):
        lib, why = native.build(int4_vnni.SOURCE, int4_vnni.COMMON + native.BUILDS[build][1], tmp_path / build)
        assert lib is not None, why
        libs.append(int4_vnni.bind(lib))
    g = torch.Generator().manual_seed(3)
    for n, k, extreme in ((36, 96, False), (259, 160, False), (64, 896, False), (64, 896, True)):
        q = torch.full((n, k), 15) if extreme else torch.randint(0, 16, (n, k), generator=g)
        tiles = int4_vnni.pack(q, (torch.rand(n, k // 32, generator=g) * 0.1).half(), torch.randn(n, k // 32, generator=g).half())
        x = torch.ones(17, k).bfloat16() if extreme else (torch.randn(17, k, generator=g) * 3).bfloat16()
        x[1::2] *= -1
        for rows in (1, 2, 3, 5, 8, 9, 17):
            vnni, avx2 = (int4_vnni.product(tiles, x[:rows], n, k, lib) for lib in libs)
            assert torch.equal(vnni, avx2), (n, k, rows)


def test_a_head_without_some_tokens_computes_the_others_with_the_same_bits():
    """Int4Linear.without: the outputs outside [lo, hi) are the whole product's, bit for bit (the same tiles' rows),
    those inside -inf; shapes it cannot skip (no tiles, bounds not multiples of 4) get the whole product."""
    if int4_vnni.library()[0] is None:
        pytest.skip(f"the int4 kernel of our own cannot run here: {int4_vnni.library()[1]}")
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(96, 48, bias=False)
    lin.weight.data = torch.randn(48, 96, generator=g)
    q = Int4Linear(lin.to(torch.bfloat16), kernel="vnni")
    for rows in (1, 2, 5):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        with torch.no_grad():
            whole = q(x)
            for lo, hi in ((16, 40), (4, 48), (20, 20)):
                y = q.without(x, (lo, hi))
                kept = torch.cat([torch.arange(lo), torch.arange(hi, 48)])
                assert torch.equal(y[:, kept], whole[:, kept]) and torch.isneginf(y[:, lo:hi]).all()
            assert torch.equal(q.without(x, (6, 40)), whole)  # 6: not a row of tiles


def test_the_draft_falls_back_to_int8_where_the_int4_product_does_not_fit(tiny):
    draft = draft_to_int4(copy.deepcopy(tiny.draft).to(torch.bfloat16))
    assert isinstance(draft.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(draft.model.layers[0].self_attn.k_proj, Int4Linear)
    assert isinstance(draft.lm_head, TokenInt8Linear)  # 259 rows: the int4 kernel wants a multiple of 16
    fp32 = draft_to_int4(copy.deepcopy(tiny.draft).float())  # the int4 kernel is slow with float32
    assert all(isinstance(m, TokenInt8Linear) for m in (fp32.model.layers[0].mlp.down_proj, fp32.model.layers[0].mlp.up_proj))
    assert not any(type(m) is torch.nn.Linear for m in (*draft.modules(), *fp32.modules()))
    ids = torch.tensor([[5, 9, 33]])
    with torch.inference_mode():
        out, out32, ref = draft(ids).logits, fp32(ids).logits, tiny.draft.float()(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert out32.dtype == torch.float32 and 0 < (out32 - ref).abs().max() < 0.05 * ref.abs().max()


def test_a_quantised_draft_stays_lossless(tiny):
    pair = with_eos(tiny, [])
    cheap = dataclasses.replace(pair, draft=draft_to_int4(copy.deepcopy(pair.draft)))
    cfg = SpecConfig(k=4, max_new_tokens=40)
    out = generate(cheap, "hello there", cfg)
    assert out.token_ids == generate(pair, "hello there", cfg, "autoregressive").token_ids
    assert sum(e.accepted for e in out.events) > 0  # its drafts were judged, and some kept
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_draft_is_the_same_draft_and_stale_files_are_rebuilt(tiny, tmp_path, dtype):
    x = torch.tensor([[5, 17, 42, 99, 7, 8, 9, 10, 11, 12]])  # 10 rows: int4 layers take their int8 twin
    path = tmp_path / "draft.safetensors"
    fresh = draft_to_int4(copy.deepcopy(tiny.draft).to(dtype), saved=path, source="weights v1")
    assert path.exists()
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    for damage in (None, "other source", "other dtype", "corrupt"):
        if damage == "corrupt":
            path.write_bytes(b"not a safetensors file")
        if damage == "other dtype":  # int8 layers (float32) or int4 ones (bfloat16) under this name: rebuilt, not misread
            draft_to_int4(copy.deepcopy(tiny.draft).to(other), saved=path, source="weights v1")
        reloaded = draft_to_int4(copy.deepcopy(tiny.draft).to(dtype), saved=path,
                                 source="weights v2" if damage == "other source" else "weights v1")
        with torch.inference_mode():
            assert torch.equal(fresh(x).logits, reloaded(x).logits)
    with safe_open(str(path), "pt") as f:  # the last load rewrote the file from this dtype
        assert f.metadata()["source"].startswith("weights v1\nint4") and f", {dtype}, " in f.metadata()["source"]
        twins = [key for key in f.keys() if "wide" in key]
    assert bool(twins) == (dtype == torch.bfloat16) and all(":wide." in key for key in twins)  # saved with their layer


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


def test_where_the_int4_kernel_cannot_be_built_the_draft_keeps_pytorchs_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.AVX512_VNNI))
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
