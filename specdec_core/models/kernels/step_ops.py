"""The small operations between a written-out forward's products (step_ops.c: norms with the residual adds, the
rotation with the cache writes, the activation, the draft's attention), built on first use (native.py)."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from .native import BUILDS, load, widest_build

SOURCE = Path(__file__).with_name("step_ops.c")
# the activation's selects vectorise only where no exception flag is kept (the same values, several times faster);
# no contraction, so that the AVX-512 build (where kquant.c's runs, with faster activations and norms than SSE2's)
# computes any other build's bits; OpenMP for the draft's attention, a key/value head a thread
FLAGS = ["-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def ops() -> ctypes.CDLL | None:
    """step_ops.c, built; None where it cannot be (a warning says why: the draft then takes the general forward)."""
    lib, _ = load(SOURCE, FLAGS + BUILDS[widest_build()][1], set(), "the draft's written-out step is not used: {why}")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    for suffix in ("", "_f32"):
        getattr(lib, "add_norm" + suffix).argtypes = [p, p, p, i, i, ctypes.c_float, p]
        getattr(lib, "rotate_write" + suffix).argtypes = [p, p, p, i, i, i, i, p, p, p, i, i]
        getattr(lib, "silu_mul" + suffix).argtypes = [p, i, i, p]
    lib.grouped_attention.argtypes = [p, p, p, i, i, i, i, i, i, ctypes.c_float, p, i]
    return lib
