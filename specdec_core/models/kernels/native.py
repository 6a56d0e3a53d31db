"""C kernels of this project (int8_vnni.c, int4_vnni.c, kquant.c, step_ops.c), built on first use with the system's C
compiler (gcc, or $CC) into the model cache, once per source and flags, and loaded with ctypes: no build step, no extra
dependency. A compiler is optional: without one (or with SPECDEC_KERNELS=off) PyTorch's products run instead."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..files import default_cache_dir

try:
    import fcntl
except ImportError:  # Windows: no lock between processes, so start one app at a time on a cache
    fcntl = None


def cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo names them; with SPECDEC_KERNELS=avx2, without the AVX-512 ones, so that
    every kernel takes the build a CPU without AVX-512 (most laptops) runs."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()
    avx2_only = os.environ.get("SPECDEC_KERNELS", "").lower() == "avx2"
    return {flag for flag in flags if not flag.startswith("avx512")} if avx2_only else flags


HEADERS = Path(__file__).parent  # what the kernels include of their own

AVX512_VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"}  # as /proc/cpuinfo names them
AVX512_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"]  # and as gcc does
AVX2 = {"avx2", "fma", "f16c"}  # x86 CPUs since about 2013, most laptops' among them, AVX-512 or not
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
# each build of a kernel: the CPU flags it needs and the compiler's flags for them, widest first
BUILDS = {"avx512-vnni": (AVX512_VNNI, AVX512_VNNI_FLAGS), "avx2": (AVX2, AVX2_FLAGS), "portable": (set(), [])}


def widest_build() -> str:
    """The widest build this CPU runs (cpu_flags: SPECDEC_KERNELS=avx2 hides AVX-512)."""
    cpu = cpu_flags()
    return next(name for name, (needs, _) in BUILDS.items() if needs <= cpu)


LOCK_WAIT_S = float(os.environ.get("SPECDEC_LOCK_TIMEOUT_S", "600"))  # a first start's longest step takes about a minute


@contextmanager
def locked(folder: Path, name: str = ".lock", timeout_s: float | None = None):
    """What the lock file `folder/name` guards, to this caller alone: another process, or another thread here (each
    opens the file anew), waits, then finds what was made. A wait past `timeout_s` (LOCK_WAIT_S) is a TimeoutError
    that says why: a start stuck on the same cache must not leave this one waiting for ever."""
    if fcntl is None:
        yield
        return
    wait = LOCK_WAIT_S if timeout_s is None else timeout_s
    limit = time.monotonic() + wait
    with open(folder / name, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > limit:
                    raise TimeoutError(f"another process has held the cache's lock {name} for over {wait:.0f} s (another "
                                       "start on the same SPECDEC_CACHE?): stop it, or start with another cache") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_leftovers(folder: Path) -> None:
    """The temporary folders (tmp*) that a start killed midway left in `folder`: removed under its lock, which every
    maker of one holds while it exists. Where the lock cannot be had now, they wait for a later start."""
    try:
        with locked(folder, timeout_s=0):
            for left in folder.glob("tmp*"):
                if left.is_dir():
                    shutil.rmtree(left, ignore_errors=True)
    except (OSError, TimeoutError):
        pass


def private_dir(folder: Path) -> str:
    """Make `folder` (0700) if it is not there; "" if only this user can write to it, else why not."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = folder.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return f"the cache's {folder.name} folder is writable by other users (or not owned by this one), so nothing is loaded from it"
    return ""


def build(source: Path, flags: list[str], folder: Path | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from `source` with `flags`, "") or (None, why there is none). The flags name the
    instruction sets, so a file's name, keyed on its source, flags and compiler, says what it runs on.
    folder: where it is built and kept (the cache's kernels/); one build at a time in each."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        return None, "no C compiler (gcc or $CC) to build it"
    # the headers it may include (exp_le0.h: beside it, else the package's) are part of the build: a change to one
    # builds again what includes it
    headers = [h.read_bytes() for h in sorted({*source.parent.glob("*.h"), *HEADERS.glob("*.h")})]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(flags).encode(), cc.encode()])).hexdigest()[:16]
    folder = folder or default_cache_dir() / "kernels"
    built = folder / f"{source.stem}-{key}.so"
    try:
        unsafe = private_dir(folder)
        if unsafe:
            return None, unsafe
        remove_leftovers(folder)
        lib = verified(built)  # built before: read without the lock, which another start may hold
        if lib is None:
            with locked(folder):
                lib = verified(built) or compiled(cc, source, flags, built)
        return lib, ""
    except (OSError, subprocess.SubprocessError, TimeoutError) as e:
        # the reason may reach a visitor's status line: no server path in it; the operator's log has the details
        detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-600:]
        warnings.warn(f"building {source.name} failed: {e} {detail}".strip(), RuntimeWarning)
        why = f"exit status {e.returncode}" if isinstance(e, subprocess.CalledProcessError) else \
            e.strerror if isinstance(e, OSError) and e.strerror else e.__class__.__name__
        return None, f"building it failed ({why}; the server's log has the compiler's message)"


def verified(built: Path) -> ctypes.CDLL | None:
    """The library at `built` where its bytes are those its build wrote (the digest kept beside it), else None: a
    truncated or replaced file is built again, never loaded."""
    try:
        if built.with_suffix(".sha256").read_text() == hashlib.sha256(built.read_bytes()).hexdigest():
            return ctypes.CDLL(str(built))
    except OSError:
        pass
    return None


def compiled(cc: str, source: Path, flags: list[str], built: Path) -> ctypes.CDLL:
    """`source` built into `built`, with its digest beside it (the caller holds the folder's lock)."""
    with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
        out, digest = Path(tmp) / built.name, Path(tmp) / "digest"
        subprocess.run([cc, *flags, f"-I{HEADERS}", str(source), "-o", str(out)], check=True, capture_output=True,
                       timeout=120)
        digest.write_text(hashlib.sha256(out.read_bytes()).hexdigest())
        out.replace(built)  # whole or not at all: another process may be loading it
        digest.replace(built.with_suffix(".sha256"))
    return ctypes.CDLL(str(built))


def load(source: Path, flags: list[str], needs: set[str], unused: str) -> tuple[ctypes.CDLL | None, str]:
    """`source` built for this CPU: (the library, "") or (None, why there is none). needs: the x86 CPU flags it
    needs (none: any CPU). Where the CPU could run it but it cannot be built, a RuntimeWarning says so: `unused`,
    with {why} in it, names what is not used and what runs instead. SPECDEC_KERNELS=off: none is built or loaded."""
    if os.environ.get("SPECDEC_KERNELS", "").lower() == "off":
        return None, "turned off by SPECDEC_KERNELS=off"
    cpu = cpu_flags()
    if needs and platform.machine() not in ("x86_64", "AMD64"):
        return None, "this CPU is not an x86 one"
    if not needs <= cpu:
        return None, f"this CPU lacks {', '.join(sorted(needs - cpu))}"
    lib, why = build(source, flags)
    if lib is None:
        warnings.warn(unused.format(why=why), RuntimeWarning)
    return lib, why
