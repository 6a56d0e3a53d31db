"""C kernels of this project (int8_vnni.c, int4_vnni.c, step_ops.c), built on first use with the system's C compiler (gcc, or
$CC) into the model cache, once per source and CPU, and loaded with ctypes: no build step, no extra dependency."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from .pair import default_cache_dir


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


_building = threading.Lock()  # a model's layers are made on several threads: one of them builds


def build(source: Path, flags: list[str], cpu: set[str]) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from `source`, "") or (None, why there is none)."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        return None, "no C compiler (gcc or $CC) to build it"
    # -march=native: a library built on one CPU may not run on another, so the CPU's flags are in its name
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(flags).encode(), cc.encode(),
                                     " ".join(sorted(cpu)).encode()])).hexdigest()[:16]
    built = default_cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    try:
        with _building:
            if not built.exists():
                built.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
                    out = Path(tmp) / built.name
                    subprocess.run([cc, *flags, str(source), "-o", str(out)], check=True, capture_output=True, timeout=120)
                    out.replace(built)  # whole or not at all: another process may be loading it
        return ctypes.CDLL(str(built)), ""
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return None, f"building it failed: {e} {detail.decode(errors='replace')[-300:]}".strip()


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
    lib, why = build(source, flags, cpu)
    if lib is None:
        warnings.warn(unused.format(why=why), RuntimeWarning)
    return lib, why
