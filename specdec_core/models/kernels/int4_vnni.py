"""The int4 draft's product of our own (int4_vnni.c) for x86 CPUs with AVX-512 VNNI or AVX2, built on first use
(native.py).

A draft step reads its weights once and waits on memory; this product streams them faster than PyTorch's int4
kernel (see int4_vnni.c). Where the CPU has neither or it cannot be built, `library()` says why and the draft keeps
PyTorch's kernel.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .native import BUILDS, load, widest_build

SOURCE = Path(__file__).with_name("int4_vnni.c")
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-lm"]
GROUP = 32


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the built kernel, its build: "avx512-vnni" or "avx2") or (None, why there is none); where the CPU could run it
    but it cannot be built, a warning says so once."""
    build = widest_build()
    build = "avx2" if build == "portable" else build  # a vector build: where the CPU lacks it, load() says so
    needs, flags = BUILDS[build]
    lib, why = load(SOURCE, COMMON + flags, needs, "the int4 draft's own product is not used: {why}; it keeps PyTorch's")
    return (bind(lib), build) if lib is not None else (None, why)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.int4_vnni_mm.restype = ctypes.c_int
    lib.int4_vnni_mm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    return lib


def fits() -> bool:
    return library()[0] is not None


def pack(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, step and low [N, K / 32] (w = low + q step) -> the kernel's tiles, [N / 4, K / 128, 320]
    bytes, N and K padded with zeros to multiples of 4 and 128."""
    n, k = q.shape
    pad_n, pad_k = -n % 4, -k % 128
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, pad_k, 0, pad_n))
    np_, kp = n + pad_n, k + pad_k
    q6 = q.view(np_ // 4, 4, kp // 128, 4, 8, 4).permute(0, 2, 4, 1, 3, 5)  # quad, block, step, output, group, byte
    nibbles = (q6[:, :, :4] | (q6[:, :, 4:] << 4)).reshape(np_ // 4, kp // 128, 256)
    lanes = lambda t: torch.nn.functional.pad(t.float(), (0, pad_k // GROUP, 0, pad_n)).view(
        np_ // 4, 4, kp // 128, 4).permute(0, 2, 1, 3).reshape(np_ // 4, kp // 128, 16).half().view(torch.uint8)
    return torch.cat([nibbles, lanes(step), lanes(low)], -1).contiguous()


def product(tiles: torch.Tensor, x: torch.Tensor, out_features: int, in_features: int,
            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16 (lib: another build of int4_vnni.c, for tests)."""
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16 or tiles.dtype != torch.uint8 \
            or tiles.shape[:2] != (-(-out_features // 4), -(-in_features // 128)):
        raise ValueError(f"the int4 product takes bfloat16 rows of {in_features}, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(len(x), out_features, dtype=torch.bfloat16)
    if (lib or library()[0]).int4_vnni_mm(tiles.data_ptr(), x.data_ptr(), len(x), out_features, in_features, None,
                                          y.data_ptr(), torch.get_num_threads()):
        raise MemoryError("no memory for the int4 product's rounded rows")
    return y
