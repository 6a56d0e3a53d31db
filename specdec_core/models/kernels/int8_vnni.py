"""The int8 target's product of our own (int8_vnni.c) for x86 CPUs with AVX-512 VNNI, built on first use.

fbgemm's dynamic int8 product costs 2 to 2.6 times as much for the 10 to 17 rows of a verification pass as for
a step's one row; this one reads each weight once for six rows at a time, so a pass costs little more than a
step. It is built on first use (native.py). Where the CPU lacks VNNI or no compiler is found,
`library()` says why and the target keeps PyTorch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .native import AVX512_VNNI, AVX512_VNNI_FLAGS, load

SOURCE = Path(__file__).with_name("int8_vnni.c")
FLAGS = ["-O3", *AVX512_VNNI_FLAGS, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
NEEDS = AVX512_VNNI


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the built kernel, "") or (None, why there is none). Where the CPU could run it but it cannot be built,
    a warning says so once: the target then keeps fbgemm's product, exact but slower in a pass."""
    lib, why = load(SOURCE, FLAGS, NEEDS, "the int8 target's own product is not used: {why}; it keeps fbgemm's")
    if lib is not None:
        lib.int8_vnni_mm.restype = ctypes.c_int
        lib.int8_vnni_mm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int]
        lib.int8_vnni_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    return lib, why


def fits(in_features: int) -> bool:
    return in_features % 4 == 0 and library()[0] is not None


class Int8Product:
    """An int8 weight [N, K] and its scale per output, in the kernel's layout, outputs padded to 32: packed from
    `qweight` [N, K], or (`Int8Product.read`) taken as `state()` gave it."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        n, k = qweight.shape
        q = (torch.cat([qweight, qweight.new_zeros(-n % 32, k)]) if n % 32 else qweight).contiguous()
        weight = torch.empty(len(q) // 16, k // 4, 16, 4, dtype=torch.int8)
        colsum = torch.empty(len(q), dtype=torch.int32)
        library()[0].int8_vnni_pack(q.data_ptr(), len(q), k, weight.data_ptr(), colsum.data_ptr(), torch.get_num_threads())
        self.place(weight, colsum, scale, bias)

    @classmethod
    def read(cls, state: dict, bias: torch.Tensor | None) -> Int8Product:
        """One made from another's `state()` (a cache file's): nothing packed again."""
        product = cls.__new__(cls)
        product.place(state["weight"], state["colsum"], state["scale"], bias)
        return product

    def place(self, weight: torch.Tensor, colsum: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, padded = len(scale), len(colsum)
        if padded % 32 or not 0 <= padded - n < 32 or weight.shape[::2] != (padded // 16, 16) or weight.dtype != torch.int8:
            raise ValueError("int8 weights in another layout than the kernel's")
        self.out_features, self.in_features = n, weight.shape[1] * 4
        self.weight, self.colsum, self.scale64 = weight.contiguous(), colsum.contiguous(), scale
        grow = lambda t: torch.cat([t.float(), t.new_zeros(padded - n, dtype=torch.float32)]).contiguous()
        self.scale = grow(scale)
        self.bias = None if bias is None else grow(bias)

    def state(self) -> dict:
        """The packed weights, their sums and the scales as given: what a cache file keeps."""
        return {"weight": self.weight, "colsum": self.colsum, "scale": self.scale64}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"the int8 product takes float32 rows of {self.in_features}, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(len(x), len(self.scale))
        lib = library()[0]
        if lib.int8_vnni_mm(self.weight.data_ptr(), self.colsum.data_ptr(), self.scale.data_ptr(),
                            None if self.bias is None else self.bias.data_ptr(), x.data_ptr(),
                            len(x), len(self.scale), self.in_features, y.data_ptr(), torch.get_num_threads()):
            raise MemoryError("no memory for the int8 product's rounded rows")
        return y[:, : self.out_features]
