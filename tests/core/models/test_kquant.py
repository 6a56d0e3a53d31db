"""The target's product on Q4_K, Q5_K, Q6_K and Q8_0 blocks and its rows' attention (kquant.c) against the block
formats' public definitions and the arithmetic they promise, for any number of rows, in both builds, with planted bugs that must
fail."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdec_core.models.kernels import kquant, native

GGML = {4: GGMLQuantizationType.Q4_K, 5: GGMLQuantizationType.Q5_K, 6: GGMLQuantizationType.Q6_K,
        8: GGMLQuantizationType.Q8_0}
KINDS = [4, 5, 6, 8]


def needs_kernel():
    if kquant.library()[0] is None:
        pytest.skip(f"the product on GGUF blocks cannot be built here: {kquant.library()[1]}")


def blocks(kind: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights of very different sizes per row, quantised to the format: [n, k / 256 inputs] bytes. Q5_K: Q4_K's scales
    with random 5-bit q; Q8_0: gguf's own quantiser."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * torch.rand(1, k, generator=g) * 0.2
    if kind == 8:
        return torch.from_numpy(quantize(w.numpy(), GGML[8]).reshape(n, -1))
    if kind == 5:
        head = kquant.quantise(w, 4).reshape(-1, 144)[:, :16]
        bits = torch.randint(0, 256, (len(head), 160), generator=g, dtype=torch.uint8)
        return torch.cat([head, bits], 1).reshape(n, -1)
    return kquant.quantise(w, kind)


def fields(raw: torch.Tensor, kind: int, n: int, k: int):
    """A block's numbers as the format defines them, read in PyTorch: (q [n, k], scales [n, sub-blocks],
    mins [n, sub-blocks] (Q4_K, Q5_K) or None, d [n, blocks] (Q8_0: [n, sub-blocks]), dmin [n, blocks] or None)."""
    size = 34 if kind == 8 else raw.numel() // n // (k // 256)
    b = raw.reshape(n, -1, size).long()
    half = lambda lo: torch.from_numpy(raw.reshape(n, -1, size)[..., lo: lo + 2].contiguous().numpy()
                                       .view(np.float16).astype(np.float32)).reshape(n, -1)
    if kind == 8:  # blocks of 32: d, 32 int8
        return b[..., 2:].to(torch.int8).long().reshape(n, k), None, None, half(0), None
    if kind in (4, 5):
        s = b[..., 4:16]
        sc = torch.cat([s[..., :4] & 63, (s[..., 8:] & 15) | (s[..., :4] >> 6) << 4], -1)
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
        qs = b[..., 16 if kind == 4 else 48:].reshape(n, -1, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], 3)  # each 64 values: 32 low nibbles, then 32 high
        if kind == 5:  # the fifth bit of value 64g + 32h + l: bit 2g + h of qh[l]
            qh = b[..., 16:48]
            q = q | torch.stack([torch.stack([(qh >> (2 * g + h)) & 1 for h in range(2)], 2) for g in range(4)], 2) << 4
        return q.reshape(n, k), sc.reshape(n, -1), mn.reshape(n, -1), half(0), half(2)
    ql, qh = b[..., :128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 32)
    low = torch.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], 3)
    high = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], 3)
    q = (low | high << 4).reshape(n, k)
    sc = b[..., 192:208].to(torch.int8).long()  # the scales are signed bytes
    return q, sc.reshape(n, -1), None, half(208), None


def reference(raw: torch.Tensor, kind: int, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """What the product promises, in PyTorch: each row rounded to int8 per block of 256, exact integer sums per
    block, then per block, in order, the same float32 operations."""
    m, k = x.shape
    q, sc, mn, d, dmin = fields(raw, kind, n, k)
    xb = x.reshape(m, -1, 256)
    top = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * torch.where(top > 0, 127 / top, 0.0)).long()  # half to even, as rintf
    dx = (top / 127)[..., 0]
    if kind == 8:  # per block of 256, its eight sub-blocks' d * float(dot) summed in order
        dots = torch.einsum("mjs,njs->mnj", xq.reshape(m, -1, 32), q.reshape(n, -1, 32))  # exact
        acc = torch.zeros(m, n)
        for blk in range(k // 256):
            v = torch.zeros(m, n)
            for j in range(8 * blk, 8 * blk + 8):
                v = v + d[:, j] * dots[..., j].float()
            acc = acc + v * dx[:, blk, None]
        return acc if bias is None else acc + bias
    size = 16 if kind == 6 else 32
    sub = lambda t: t.reshape(*t.shape[:-1], -1, size)
    dots = torch.einsum("mjs,njs->mnj", sub(xq.reshape(m, k)), sub(q))  # [m, n, sub-blocks], exact int64
    xsum = sub(xq.reshape(m, k)).sum(-1)  # [m, sub-blocks]
    per = 256 // size
    isum = (dots * sc).reshape(m, n, -1, per).sum(-1)  # [m, n, blocks]
    msum = (xsum[:, None] * (sc if kind == 6 else mn)).reshape(m, n, -1, per).sum(-1)
    acc = torch.zeros(m, n)
    for blk in range(k // 256):
        if kind != 6:
            v = d[:, blk] * isum[..., blk].float() - dmin[:, blk] * msum[..., blk].float()
        else:
            v = d[:, blk] * (isum[..., blk] - 32 * msum[..., blk]).float()
        acc = acc + v * dx[:, blk, None]
    return acc if bias is None else acc + bias


@pytest.mark.parametrize("kind", KINDS)
def test_the_blocks_read_as_the_format_defines_them(kind):
    """The lookup of rows (Q4_K, Q6_K) and the PyTorch reading above both give GGUF's own dequantised values, bit for
    bit."""
    needs_kernel()
    n, k = 32, 512
    raw = blocks(kind, n, k)
    want = torch.from_numpy(dequantize(raw.numpy(), GGML[kind]).reshape(n, k))
    if kind in kquant.ROW_KINDS:
        assert torch.equal(kquant.dequantise_rows(raw, kind, k, torch.arange(n)), want)
    q, sc, mn, d, dmin = fields(raw, kind, n, k)
    if kind == 8:
        assert torch.equal(d.repeat_interleave(32, 1) * q.float(), want)
        return
    size = 16 if kind == 6 else 32
    w = d.repeat_interleave(256, 1) * sc.repeat_interleave(size, 1).float() * (q - 32 if kind == 6 else q).float()
    if kind != 6:
        w = w - dmin.repeat_interleave(256, 1) * mn.repeat_interleave(size, 1).float()
    assert torch.equal(w, want)


@pytest.mark.parametrize("kind", [4, 6])
def test_quantised_blocks_are_close_to_the_weights(kind):
    torch.manual_seed(0)
    w = torch.randn(48, 768)
    raw = kquant.quantise(w, kind)
    back = torch.from_numpy(dequantize(raw.numpy(), GGML[kind]).reshape(48, 768))
    assert ((back - w).norm() / w.norm()).item() < (0.1 if kind == 4 else 0.03)


def run(lib, kind, raw, x, n, bias):
    return kquant.product(kquant.pack(raw, kind, n, x.shape[1], lib), kind, x, n, bias, lib)


def agrees(lib, kind) -> bool:
    """Whether `lib` computes the reference's bits for 1 to 17 and 65 rows, with and without a bias, over three blocks
    of 48 outputs (three groups of 16); rows of very different sizes and a row of zeros. kind "attention": the rows'
    attention's bits (attention_agrees)."""
    if kind == "attention":
        return attention_agrees(lib)
    n, k = 48, 768
    raw = blocks(kind, n, k, seed=kind)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(65, k, generator=g) * torch.rand(65, 1, generator=g) * 10
    x[3] = 0
    x[5, :256] = 0  # one block of zeros: its scale is 0, not a division by it
    for bias in (torch.randn(n, generator=g), None):
        want = reference(raw, kind, x, n, bias)
        for rows in (*range(1, 18), 65):
            if not torch.equal(run(lib, kind, raw, x[:rows], n, bias), want[:rows]):
                return False
    raw, x = extremes(raw, kind, k)
    return torch.equal(run(lib, kind, raw, x, n, None), reference(raw, kind, x, n, None))


def extremes(raw: torch.Tensor, kind: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every q at its largest (Q8_0: -128, the largest magnitude), and rows whose every activation rounds to 127 or
    -127: the largest integer sums a build's narrower partial sums (AVX2's int16) must hold."""
    size = 34 if kind == 8 else {4: 144, 5: 176, 6: 210}[kind]
    b = raw.reshape(-1, size).clone()
    if kind == 8:
        b[:, 2:] = 0x80
    else:
        b[:, {4: slice(16, 144), 5: slice(16, 176), 6: slice(0, 192)}[kind]] = 0xFF
    x = torch.ones(4, k)
    x[1], x[2, ::2], x[3, 1::2] = -1, -1, -1
    return b.reshape(raw.shape), x


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def exp_le0(x: torch.Tensor) -> torch.Tensor:
    """kquant.c's exponential for x <= 0, in float32 operations one at a time (torch fuses none)."""
    t = x.clamp(min=-87.0) * f32(1.44269504088896341)
    k = (t + 12582912.0) - 12582912.0
    f = (t - k) * f32(0.693147180559945)
    p = f32(1.0) / f32(5040.0)
    for c in (720.0, 120.0, 24.0, 6.0, 2.0, 1.0):
        p = p * f + f32(1.0) / f32(c)
    p = p * f + 1.0
    two_k = torch.bitwise_left_shift(k.to(torch.int32) + 127, 23).view(torch.float32)
    return p * two_k


def lanes_sum(acc: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [...]: halves of 8, 4, 2 and 1 added, as kquant.c's tree."""
    for w in (8, 4, 2, 1):
        acc = acc[..., :w] + acc[..., w: 2 * w]
    return acc[..., 0]


def attention_reference(q, keys, values, counts, idx, scale) -> torch.Tensor:
    """What the rows' attention promises, in PyTorch float32, for each row and head alone: a key's score summed in
    16 lanes (position t in lane t mod 16, in order), then lanes_sum; the exponential above; the weights summed in
    16 lanes (key j in lane j mod 16) then lanes_sum; the values summed key by key, in order; then one division."""
    heads, n, d = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(n, heads, d)
    for r in range(n):
        pos = torch.arange(int(counts[r])) if idx is None else idx[r, : int(counts[r])].long()
        for h in range(heads):
            k, v = keys[0, h // group, pos], values[0, h // group, pos]
            qs = q[h, r] * f32(scale)
            acc = torch.zeros(len(pos), 16)
            for c in range(d // 16):
                acc = acc + qs[16 * c: 16 * c + 16] * k[:, 16 * c: 16 * c + 16]
            s = lanes_sum(acc)
            e = exp_le0(s - s.max())
            lanes = torch.zeros(16)
            for c in range(0, len(pos), 16):
                lanes = lanes + torch.nn.functional.pad(e[c: c + 16], (0, 16 - len(e[c: c + 16])))
            o = torch.zeros(d)
            for j in range(len(pos)):
                o = o + e[j] * v[j]
            out[r, h] = o / lanes_sum(lanes)
    return out.reshape(n, heads * d)


def attention_cases():
    """(q, keys, values, plan, scale): chains of 1, 5 and 9 rows after 40 cached positions and a tree of 6 nodes, heads
    of 128 and 64 numbers (the vector build's two widths) and of 32 (its portable loop), 4 query heads on 2 key/value
    heads; the keys in a buffer with room behind them, as a cache's."""
    g = torch.Generator().manual_seed(3)
    for d in (128, 64, 32):
        for n, parents in ((1, None), (5, None), (9, None), (6, [-1, 0, 0, 1, -1, 4])):
            buffer = [torch.randn(1, 2, 64, d, generator=g) * 2 for _ in range(2)]
            keys, values = (b[:, :, : 40 + n] for b in buffer)
            q = torch.randn(4, n, d, generator=g) * 3
            mask = None
            if parents:
                from specdec_core.cache import TreeInput
                mask = TreeInput(parents).model_inputs(40, "sdpa", "cpu")["attention_mask"][0, 0]
            yield q, keys, values, kquant.visible(40, n, mask), d ** -0.5


def attention_agrees(lib) -> bool:
    """Whether `lib`'s rows' attention is the reference's bits in every case, and each row of a pass, computed alone
    (one row, its own keys), is the same bits too."""
    for q, keys, values, (counts, idx), scale in attention_cases():
        got = kquant.attention(q, keys, values, (counts, idx), scale, lib)
        if not torch.equal(got, attention_reference(q, keys, values, counts, idx, scale)):
            return False
        for r in range(q.shape[1]):
            alone = (counts[r: r + 1], None if idx is None else idx[r: r + 1])
            if not torch.equal(kquant.attention(q[:, r: r + 1], keys, values, alone, scale, lib), got[r: r + 1]):
                return False
    return True


def test_the_rows_attention_is_its_reference_arithmetic_and_a_row_alone():
    """Each row's attention (a step's, and every row of a chain or tree pass) is the reference's bits: a pass
    repeats a step's arithmetic. And it is attention: within float rounding of float64 softmax attention."""
    needs_kernel()
    assert attention_agrees(kquant.kernel())
    for q, keys, values, (counts, idx), scale in attention_cases():
        got = kquant.attention(q, keys, values, (counts, idx), scale).reshape(q.shape[1], 4, -1)
        for r in range(q.shape[1]):
            pos = torch.arange(int(counts[r])) if idx is None else idx[r, : int(counts[r])].long()
            for h in range(4):
                k, v = keys[0, h // 2, pos].double(), values[0, h // 2, pos].double()
                want = torch.softmax(q[h, r].double() @ k.T * scale, -1) @ v
                torch.testing.assert_close(got[r, h].double(), want, rtol=1e-5, atol=1e-5)


def test_the_rows_attention_refuses_what_it_cannot_compute():
    needs_kernel()
    q, keys, values, plan, scale = next(attention_cases())
    with pytest.raises(ValueError, match="multiple of 16"):
        kquant.attention(q.double(), keys, values, plan, scale)
    with pytest.raises(ValueError, match="keys they can see"):
        kquant.attention(q, keys[:, :, :10], values[:, :, :10], plan, scale)
    with pytest.raises(ValueError, match="float32"):  # values of another type than the keys
        kquant.attention(q, keys, values.double(), plan, scale)
    with pytest.raises(ValueError, match="float32"):  # 3 query heads cannot share 2 key/value heads
        kquant.attention(q[:3], keys, values, plan, scale)


@pytest.mark.parametrize("kind", KINDS)
def test_the_product_is_the_reference_arithmetic_for_any_number_of_rows(kind):
    """Every row count through tiles of 1 to 4 rows: the same bits as the reference, so a row's output cannot
    depend on the rows beside it, in a step or in any pass."""
    needs_kernel()
    assert agrees(kquant.kernel(), kind)


def build(tmp_path, monkeypatch, source: str, flags: list[str]):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    path = tmp_path / "kquant.c"
    path.write_text(source)
    lib, why = native.build(path, kquant.COMMON + flags)
    assert lib is not None, why
    return kquant.bind(lib)


def test_the_portable_build_gives_the_same_bits(tmp_path, monkeypatch):
    """The fallback for CPUs without AVX2, forced here: the same arithmetic, so the same logits."""
    needs_kernel()
    lib = build(tmp_path, monkeypatch, kquant.SOURCE.read_text(), [])
    assert all(agrees(lib, kind) for kind in KINDS) and attention_agrees(lib)


AVX2_MUTANTS = {  # the AVX2 build's int16 partial sums made to hold more pairs than they can
    "Q5_K's pairs widened once a sub-block": (5, "if (five ? c % 2 == 1 : c % 4 == 3)", "if (c % 4 == 3)"),
    "Q6_K's four pairs summed in int16": (
        6, "_mm256_add_epi32(_mm256_madd_epi16(a, sc[h]), _mm256_madd_epi16(c, sc[h]))",
        "_mm256_madd_epi16(_mm256_add_epi16(a, c), sc[h])"),
    "Q8_0's q + 128 multiplied unsigned": (
        8, "_mm256_maddubs_epi16(size[h], _mm256_sign_epi8(xr, q[h]))",
        "_mm256_sub_epi16(_mm256_maddubs_epi16(_mm256_xor_si256(q[h], offset), xr), _mm256_maddubs_epi16(offset, xr))"),
}


@pytest.mark.parametrize("name", [None, *AVX2_MUTANTS])
def test_the_avx2_build_gives_the_same_bits_and_catches_its_overflows(tmp_path, monkeypatch, name):
    """The build for x86 CPUs without AVX-512 (most laptops): the reference's bits for every kind, extremes included
    (agrees); each planted overflow of its int16 sums fails, which random weights alone would not show."""
    needs_kernel()
    if not native.AVX2 <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    source = kquant.SOURCE.read_text()
    if name is None:
        lib = build(tmp_path, monkeypatch, source, native.AVX2_FLAGS)
        assert all(agrees(lib, kind) for kind in KINDS) and attention_agrees(lib)
        return
    kind, old, new = AVX2_MUTANTS[name]
    assert source.count(old) == 1
    assert not agrees(build(tmp_path, monkeypatch, source.replace(old, new), native.AVX2_FLAGS), kind)


MUTANTS = {  # a planted bug: (kind it breaks, old text, new text), each in one build
    "a wrong sub-block scale (Q4_K)": (4, "const __m512i sc = h ? _mm512_srli_epi32(scs, 16) : _mm512_and_si512(scs, half);",
                                       "const __m512i sc = _mm512_and_si512(scs, half);"),
    "a wrong min (Q4_K)": (4, "x->p32 + ((size_t)(m0 + r) * nb + b) * 4 + p", "x->p32 + ((size_t)(m0 + r) * nb + b) * 4"),
    "a dropped block (Q6_K)": (6, "for (int b = 0; b < nb; b++, w += Q6_PACKED) {\n        __m512i",
                               "for (int b = 0; b < nb - 1; b++, w += Q6_PACKED) {\n        __m512i"),
    "nibble order swapped (Q4_K)": (4, "dot[r] = dpb(dot[r], lo, xr);\n                        dot[r] = dpb(dot[r], hi, xr + 1);",
                                    "dot[r] = dpb(dot[r], hi, xr);\n                        dot[r] = dpb(dot[r], lo, xr + 1);"),
    "a broadcast from the next activations (Q6_K)": (6, "dot = dpb(dot, q[3], xr + 3);", "dot = dpb(dot, q[3], xr + 4);"),
    "Q6_K's high bits one place off": (6, "_mm512_slli_epi16(qb, 2)", "_mm512_slli_epi16(qb, 3)"),
    "Q6_K's offset of 32 forgotten": (6, "_mm512_slli_epi32(csum, 5)", "_mm512_slli_epi32(csum, 4)"),
    "a tile's rows all read its first (Q4_K)": (4, "x->q + (size_t)(m0 + r) * K + b * QK + 8 * c);\n                        dot[r] = dpb",
                                                "x->q + (size_t)m0 * K + b * QK + 8 * c);\n                        dot[r] = dpb"),
    "activations rounded toward zero": (4, "_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC", "_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC"),
    "a row left out of uneven tiles": (6, "M / tiles + (t < M % tiles);\n        __m512", "M / tiles;\n        __m512"),
    "a packed scale from the wrong output": (4, "dst[64 + p * 32 + o * 2] = sc[2 * p]", "dst[64 + p * 32 + (o ^ 1) * 2] = sc[2 * p]"),
    "the file's high nibbles packed as low ones (Q4_K)": (4, "src + qs + 32 * g + l % 32, l >= 32", "src + qs + 32 * g + l % 32, l < 32"),
    "Q6_K's top bits packed from the wrong pair": (6, ">> (2 * j)) & 0x03030303u", ">> (2 * j + 1)) & 0x03030303u"),
    "Q5_K's fifth bit of a high nibble taken from the low's place": (5, "bit4(qh, 2 * i + 1)", "bit4(qh, 2 * i)"),
    "Q5_K's fifth bits packed from the wrong half": (5, "2 * (v / 64) + (v % 64) / 32", "2 * (v / 64)"),
    "Q8_0's offset of 128 taken as 127": (8, "_mm512_set1_epi32(128 * xsum)", "_mm512_set1_epi32(127 * xsum)"),
    "Q8_0's sums of the wrong sub-block": (8, "j % 2 ? (uint32_t)pair >> 16", "j % 2 == 0 ? (uint32_t)pair >> 16"),
    "Q8_0's scale of the next sub-block": (8, "(const __m256i*)(w + j * 32)", "(const __m256i*)(w + (j ^ 1) * 32)"),
    "a query head reading another key/value head": ("attention", "keys + (size_t)kv * stride", "keys + (size_t)(kv ^ 1) * stride"),
    "a pass's rows seeing the first row's keys": ("attention", "counts[r],", "counts[0],"),
    "the exponential's series cut short": ("attention", "    p = p * f + 1.f / 6.f;\n", ""),
    "a score's lanes added in another tree (vector build)": ("attention", "_mm_movehl_ps(a4, a4)", "_mm_shuffle_ps(a4, a4, 0x1b)"),
    "the keys of a tree node read in the chain's order (vector build)": (
        "attention", "keys + (size_t)(idx ? idx[j] : j) * 16 * D", "keys + (size_t)j * 16 * D"),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """Each planted bug's build of kquant.c (or why it has none), compiled side by side: a compiler per core."""
    needs_kernel()
    if kquant.library()[1] != "avx512-vnni":
        pytest.skip("the planted bugs are in the AVX-512 VNNI build, which this CPU cannot run")
    texts = {"kquant.c": kquant.SOURCE.read_text(), "exp_le0.h": (native.HEADERS / "exp_le0.h").read_text()}
    # -O1: half the compile time of -O3, the same arithmetic (the intrinsics are explicit, no contraction): the
    # unplanted source built so (None) must agree, as test_the_planted_builds_flags_compute_the_reference checks
    flags = ["-O1" if flag == "-O3" else flag for flag in kquant.COMMON] + native.AVX512_VNNI_FLAGS

    def compiled(name):
        old, new = MUTANTS[name][1:] if name else ("", "")
        if name and sum(text.count(old) for text in texts.values()) != 1:
            return f"its text is not once in kquant.c and the header it includes: {old!r}"
        folder = tmp_path_factory.mktemp("planted")  # a header here comes before the package's
        for file, text in texts.items():
            (folder / file).write_text(text.replace(old, new) if name else text)
        lib, why = native.build(folder / "kquant.c", flags, folder)
        return why or kquant.bind(lib)

    names = [None, *MUTANTS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(compiled, names)))


@pytest.mark.parametrize("kind", [*KINDS, "attention"])
def test_the_planted_builds_flags_compute_the_reference(kind, planted):
    assert not isinstance(planted[None], str), planted[None]
    assert agrees(planted[None], kind)


@pytest.mark.parametrize("name", MUTANTS)
def test_each_planted_bug_fails_the_reference_test(name, planted):
    assert not isinstance(planted[name], str), planted[name]
    assert not agrees(planted[name], MUTANTS[name][0])


def test_the_product_refuses_what_does_not_fit():
    needs_kernel()
    raw = blocks(4, 32, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        kquant.KQuantLinear(raw, 4, 200, 32)
    with pytest.raises(ValueError, match="take"):
        kquant.KQuantLinear(raw[:16], 4, 256, 32)
    packed = kquant.pack(raw, 4, 32, 256)
    short, other, strided = (torch.empty(len(packed) - 1, dtype=torch.uint8), torch.empty(len(packed)),
                             torch.empty(len(packed), 2, dtype=torch.uint8)[:, 0])
    for room in (short, other, strided):
        with pytest.raises(ValueError, match="buffer does not fit"):
            kquant.pack(raw, 4, 32, 256, into=room)
    room = torch.zeros(len(packed) + 8, dtype=torch.uint8)
    assert torch.equal(kquant.pack(raw, 4, 32, 256, into=room[8:]), packed) and torch.equal(room[8:], packed)
    with pytest.raises(ValueError, match="do not match"):
        kquant.product(packed, 4, torch.randn(2, 512), 32)
    with pytest.raises(ValueError, match="do not match"):
        kquant.product(packed, 4, torch.randn(2, 256), 32, torch.randn(31))


def test_without_the_product_the_blocks_are_refused_by_name(monkeypatch):
    from specdec_core import load_pair
    from specdec_core.models import load

    monkeypatch.setattr(load, "kquant_library", lambda: (None, "no C compiler (gcc or $CC) to build it"))
    with pytest.raises(ValueError, match="cannot run here: no C compiler"):
        load_pair("bundled", target_quant="blocks")


@pytest.mark.parametrize("build, want", [("avx512-vnni", "blocks"), ("avx2", "blocks"), ("portable", "int8"),
                                         (None, "int8")])
def test_every_target_runs_on_blocks_by_default_where_their_fast_product_runs(monkeypatch, build, want):
    """The CPU default: the blocks where the AVX-512 VNNI or AVX2 build runs, for the bundled target, a GGUF one and a
    Hub one (its values made Q8_0 blocks); the portable build (one lane at a time) and no build at all fall back to the
    int8 target, exact too. The tiny pair and GPUs as loaded."""
    from specdec_core.models import load

    monkeypatch.setattr(load, "kquant_library", lambda: (object() if build else None, build or "no C compiler"))
    cpu = torch.device("cpu")
    for target in ("bundled", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct-GGUF:q4_k_m", "x.gguf"):
        assert load.auto_target_quant(target, cpu) == want
    assert load.auto_target_quant("tiny", cpu) == "off"
    assert load.auto_target_quant("bundled", torch.device("meta")) == "off"
