"""The target's products on a GGUF's own blocks (kquant.c), built on first use (native.py): Q4_K, Q5_K and Q6_K, and
Q8_0 (Q4_0 and Q5_0 moved into it losslessly: the same values, read at 8.5 bits a weight).

The file's weights are read as they are: repacked once at load, losslessly, so that a vector lane is an output,
never turned into another precision. A row of activations is rounded to int8 per block of 256; every block's
integer sum is exact, and its float operations are the same for a row whatever rows come with it, so a position's
logits are the same, bit for bit, in a one-token step and in any verification pass. The product reads 4.5 (Q4_K),
5.6 (Q5_K), 6.6 (Q6_K) or 8.5 (Q8_0) bits a weight: a decoding step, which waits on memory, reads no more than a
Q4_K_M, Q5_K_M, Q6_K or Q8_0 file holds.

The exact target's attention is here too (`attention`): each row of a pass computed alone, as a step computes it.

Three builds of one source: AVX-512 VNNI where the CPU has it, else AVX2, else portable C; all give the same bits.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .native import BUILDS, load, widest_build

SOURCE = Path(__file__).with_name("kquant.c")
COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
QK = 256
RAW = {4: 144, 5: 176, 6: 210, 8: 272}  # bytes of 256 inputs in the file: Q4_K, Q5_K, Q6_K, eight Q8_0 blocks
PACKED = {4: 2368, 5: 2880, 6: 3360, 8: 4352}  # bytes of 16 outputs' 256 inputs in the packed layout
GGML_TYPES = {12: 4, 13: 5, 14: 6, 8: 8}  # GGML's type numbers of Q4_K, Q5_K, Q6_K, Q8_0: the kinds computed on
NAMES = {4: "Q4_K", 5: "Q5_K", 6: "Q6_K", 8: "Q8_0"}
ROW_KINDS = (4, 6)  # the kinds whose rows kquant_rows reads (an embedding's)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kquant_mm.restype = ctypes.c_int
    lib.kquant_mm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 \
        + [ctypes.c_void_p, ctypes.c_int]
    lib.kquant_pack.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.kquant_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.rows_attention.restype = ctypes.c_int
    lib.rows_attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2 \
        + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the kernel, its build: "avx512-vnni", "avx2" or "portable") or (None, why there is none)."""
    build = widest_build()
    lib, why = load(SOURCE, COMMON + BUILDS[build][1], set(), "the target's product on GGUF blocks cannot be built: {why}")
    return (bind(lib), build) if lib is not None else (None, why)


def kernel() -> ctypes.CDLL:
    lib, why = library()
    if lib is None:
        raise RuntimeError(f"The product on GGUF blocks is not available: {why}")
    return lib


def packed_size(kind: int, n: int, k: int) -> int:
    return n // 16 * (k // QK) * PACKED[kind]


def pack(raw: torch.Tensor, kind: int, n: int, k: int, lib: ctypes.CDLL | None = None,
         into: torch.Tensor | None = None) -> torch.Tensor:
    """The file's blocks [n, k / 256] in the kernel's layout, in a new tensor or `into` (lib: another build of
    kquant.c, for tests)."""
    check_shape(kind, n, k, raw)
    packed = torch.empty(packed_size(kind, n, k), dtype=torch.uint8) if into is None else into
    if packed.dtype != torch.uint8 or packed.shape != (packed_size(kind, n, k),) or not packed.is_contiguous():
        raise ValueError("the packed weights' buffer does not fit them")
    (lib or kernel()).kquant_pack(raw.data_ptr(), n, k, kind, packed.data_ptr())
    return packed


def product(packed: torch.Tensor, kind: int, x: torch.Tensor, n: int, bias: torch.Tensor | None = None,
            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, k] float32 times the packed weights [n, k] -> [M, n] float32, + bias [n]."""
    x = x.float().contiguous()
    if packed.dtype != torch.uint8 or packed.numel() != packed_size(kind, n, x.shape[1]) \
            or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != n or not bias.is_contiguous())):
        raise ValueError("the blocks product's weights, rows and bias do not match")
    y = torch.empty(len(x), n)
    if (lib or kernel()).kquant_mm(packed.data_ptr(), kind, None if bias is None else bias.data_ptr(), x.data_ptr(),
                                   len(x), n, x.shape[1], y.data_ptr(), torch.get_num_threads()):
        raise MemoryError("no memory for the blocks product's rounded rows")
    return y


def visible(length: int, n: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each of n rows after `length` cached positions attends to, as `attention` takes it: (counts [n] int32, the
    positions [n, most] int32 or None). mask None: a chain, row i sees the first length + i + 1 positions; else
    booleans [n, >= length + n] (a tree's), a row's positions in order."""
    if mask is None:
        return torch.arange(length + 1, length + n + 1, dtype=torch.int32), None
    seen = mask[:, : length + n]
    counts = seen.sum(-1, dtype=torch.int32)
    order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True)  # the seen positions first, in order
    return counts, order[:, : int(counts.max())].to(torch.int32).contiguous()


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: tuple, scale: float,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Each row's attention computed alone (kquant.c), the same bits in a step and in any pass: q [heads, n, d]
    float32; keys, values [1, kv_heads, S, d] float32, each position's d numbers contiguous (a cache's buffers);
    plan: `visible`'s. Returns [n, heads * d]."""
    heads, n, d = q.shape
    counts, idx = plan
    if {q.dtype, keys.dtype, values.dtype} != {torch.float32} or keys.stride() != values.stride() \
            or keys.stride()[2:] != (d, 1) or d % 16 or heads % keys.shape[1] or len(counts) != n \
            or int(counts.max()) > keys.shape[2]:
        raise ValueError("the rows' attention needs float32 rows of a multiple of 16 and keys they can see")
    q, out = q.contiguous(), torch.empty(n, heads * d)
    if (lib or kernel()).rows_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(1), n, heads,
                                        keys.shape[1], d, counts.data_ptr(), None if idx is None else idx.data_ptr(),
                                        0 if idx is None else idx.shape[1], scale, out.data_ptr(),
                                        torch.get_num_threads()):
        raise MemoryError("no memory for the attention's scores")
    return out


def as_bytes(raw) -> torch.Tensor:
    """A uint8 tensor over `raw` (a numpy array or memmap, or a tensor), without a copy where it can."""
    t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    return t.contiguous()


def check_shape(kind: int, out_features: int, in_features: int, raw: torch.Tensor) -> None:
    if kind not in RAW or not fits(out_features, in_features):
        raise ValueError(f"a {NAMES.get(kind, kind)} product needs inputs a multiple of {QK} and outputs of 16, got "
                         f"[{out_features}, {in_features}]")
    if raw.dtype != torch.uint8 or raw.numel() != out_features * in_features // QK * RAW[kind]:
        raise ValueError(f"{NAMES[kind]} weights [{out_features}, {in_features}] take "
                         f"{out_features * in_features // QK * RAW[kind]} bytes, got {raw.numel()} of {raw.dtype}")


class KQuantLinear(nn.Module):
    """A Linear on blocks of one of the kinds (the file's bytes, [out, in / 256 inputs]); float32 in and out. into: where
    to pack them (a slice of a buffer shared with the projections computed with it)."""

    def __init__(self, raw, kind: int, in_features: int, out_features: int, bias: torch.Tensor | None = None,
                 into: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.packed = pack(as_bytes(raw), kind, out_features, in_features, into=into)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """Only its shape and device are real (what callers read of a Linear's weight); the values are in `packed`."""
        return torch.zeros(1).expand(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = product(self.packed, self.kind, x.reshape(-1, self.in_features), self.out_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def dequantise_rows(raw: torch.Tensor, kind: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of Q4_K/Q6_K weights [N, in / 256 blocks] as float32 [len(ids), in]: an embedding lookup."""
    raw = raw.contiguous()
    ids = ids.to(torch.int64).contiguous()
    n = raw.numel() // (in_features // QK * RAW[kind])
    if kind not in ROW_KINDS or raw.dtype != torch.uint8 or in_features % QK or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n)):
        raise ValueError(f"rows of Q{kind}_K weights [{n}, {in_features}] asked for outside them, or weights of another type")
    if library()[0] is None:  # no compiler: the same arithmetic in PyTorch
        return rows_in_torch(raw, kind, in_features, ids)
    out = torch.empty(len(ids), in_features)
    kernel().kquant_rows(raw.data_ptr(), ids.data_ptr(), len(ids), in_features, kind, out.data_ptr())
    return out


def rows_in_torch(raw: torch.Tensor, kind: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """dequantise_rows without the kernel: the same float32 operations in the same order (kquant_row), so the
    same bits."""
    b = raw.reshape(-1, in_features // QK * RAW[kind])[ids].reshape(len(ids), -1, RAW[kind]).long()  # [rows, blocks, bytes]
    half = lambda lo: (b[..., lo] | b[..., lo + 1] << 8).to(torch.int16).view(torch.float16).float()[..., None]
    if kind == 4:  # d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles
        s = b[..., 4:16]
        sc = torch.cat([s[..., :4] & 63, s[..., 8:] & 15 | (s[..., :4] >> 6) << 4], -1)
        m = torch.cat([s[..., 4:8] & 63, s[..., 8:] >> 4 | (s[..., 4:8] >> 6) << 4], -1)
        qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], 3).reshape(*b.shape[:2], 8, 32).float()
        values = half(0)[..., None] * sc[..., None].float() * q - half(2)[..., None] * m[..., None].float()
    else:  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
        ql, qh = b[..., :128].reshape(*b.shape[:2], 2, 1, 64), b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
        # per half, values l, l + 32, l + 64, l + 96: ql[l] & 15, ql[l + 32] & 15, ql[l] >> 4, ql[l + 32] >> 4
        low = torch.cat([ql & 15, ql >> 4], 3).reshape(*b.shape[:2], 2, 4, 32)
        high = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], 3)
        q = (low | high << 4).reshape(*b.shape[:2], 16, 16).float() - 32
        sc = b[..., 192:208].to(torch.int8).float()
        values = half(208)[..., None] * sc[..., None] * q
    return values.reshape(len(ids), in_features)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """Float weights [N, K] as Q8_0 blocks in GGUF's layout, uint8 [N, K / 32 * 34]: each 32 inputs' largest magnitude
    / 127 as d (float16), and q = w / d rounded (half to even). How a target without blocks of its own (a Hub
    checkpoint's) computes on them."""
    blocks = w.detach().float().reshape(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    scale = d.float()
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
    return torch.cat([d.view(torch.uint8), q.to(torch.int8).view(torch.uint8)], -1).reshape(w.shape[0], -1)


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be computed on blocks: inputs a multiple of 256, outputs of 16."""
    return in_features % QK == 0 and out_features % 16 == 0


def quantise(w: torch.Tensor, kind: int) -> torch.Tensor:
    """Float weights [N, K] as Q4_K or Q6_K blocks in the file's layout, uint8 [N, K / 256 * block bytes]: for tests
    and models that come without blocks of their own. A plain choice of scales (each sub-block's range), not the
    error-minimising search of GGUF's quantisers."""
    w = w.detach().double().reshape(w.shape[0], -1, QK)  # [N, blocks, 256]
    n, nb, _ = w.shape
    half = lambda v: torch.as_tensor(v.float().numpy().astype(np.float16).view(np.uint8)).reshape(n, nb, 2)
    if kind == 6:
        sub = w.reshape(n, nb, 16, 16)
        signed = sub.gather(-1, sub.abs().argmax(-1, keepdim=True))[..., 0]  # each sub-block's value of largest magnitude
        scale = -signed / 32  # (q - 32) * scale reaches it at q = 0
        d = (scale.abs().amax(-1) / 127).float().double()
        sc = torch.where(d[..., None] > 0, torch.round(scale / d[..., None].clamp(min=1e-30)), 0).clamp(-128, 127)
        step = (d.float().half().double()[..., None] * sc)[..., None]
        q = torch.where(step != 0, torch.round(sub / torch.where(step == 0, 1, step)), 0).clamp(-32, 31).long() + 32
        q = q.reshape(n, nb, 2, 4, 32)  # halves of 128, quarters of 32, then position l
        ql = (q[:, :, :, 0] & 15 | (q[:, :, :, 2] & 15) << 4, q[:, :, :, 1] & 15 | (q[:, :, :, 3] & 15) << 4)
        ql = torch.stack(ql, 3).reshape(n, nb, 128)
        qh = sum((q[:, :, :, i] >> 4) << (2 * i) for i in range(4)).reshape(n, nb, 64)
        out = [ql, qh, sc.long() & 0xFF, half(d)]
    else:
        sub = w.reshape(n, nb, 8, 32)
        low, high = sub.amin(-1).clamp(max=0), sub.amax(-1).clamp(min=0)
        scale, mins = (high - low) / 15, -low
        d, dmin = (scale.amax(-1) / 63).float().double(), (mins.amax(-1) / 63).float().double()
        sc = torch.where(d[..., None] > 0, torch.round(scale / d[..., None].clamp(min=1e-30)), 0).clamp(0, 63).long()
        m = torch.where(dmin[..., None] > 0, torch.round(mins / dmin[..., None].clamp(min=1e-30)), 0).clamp(0, 63).long()
        step = (d.float().half().double()[..., None] * sc)[..., None]
        offset = (dmin.float().half().double()[..., None] * m)[..., None]
        q = torch.where(step != 0, torch.round((sub + offset) / torch.where(step == 0, 1, step)), 0).clamp(0, 15).long()
        q = q.reshape(n, nb, 4, 2, 32)  # chunks of 64: low nibbles the first 32, high the next
        qs = (q[:, :, :, 0] | q[:, :, :, 1] << 4).reshape(n, nb, 128)
        s = torch.zeros(n, nb, 12, dtype=torch.long)
        s[..., :4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
        s[..., 4:8] = m[..., :4] | (m[..., 4:] >> 4) << 6
        s[..., 8:] = sc[..., 4:] & 15 | (m[..., 4:] & 15) << 4
        out = [half(d), half(dmin), s, qs]
    return torch.cat([t.to(torch.uint8) for t in out], -1).reshape(n, -1)
