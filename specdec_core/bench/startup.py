"""Start-up: `python app.py` timed until its "Ready" line, a first start with an empty cache, then warm starts.

python -m specdec_core.bench.startup --warm 3 --json docs/startup.json

Each start runs the app as README says, in a child process on a free port; the resident memory is read from
/proc two seconds after "Ready", the cache's size from the files in it. The empty cache is a new folder
(SPECDEC_CACHE), removed afterwards unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..models.files import file_digest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def start(cache: Path, limit_s: float, pair: str = "bundled") -> dict:
    """One start of the app: seconds until "Ready", its status line, memory after."""
    env = dict(os.environ, SPECDEC_CACHE=str(cache), SPECDEC_PORT=str(free_port()), SPECDEC_PAIR=pair,
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for line in app.stdout:
            if line.startswith(("Ready:", "Could not load")):
                seconds = time.perf_counter() - t0
                time.sleep(2)
                return {"seconds": seconds, "status": line.strip(), "resident_mb": resident_mb(app.pid),
                        "cache_mb": folder_mb(cache)}
            if time.perf_counter() - t0 > limit_s:
                break
        raise RuntimeError(f"no Ready line within {limit_s:.0f} s")
    finally:
        app.kill()
        app.wait()


def checks(cache: Path) -> dict:
    """What a start spends checking the cached weights and kernels it runs from: each file with a digest beside it
    (NAME.sha256 for weights NAME, a kernel's in place of its .so) is hashed again (SHA-256) as a start does, and
    timed."""
    timed = {}
    for sidecar in sorted(cache.rglob("*.sha256")):
        made = next((p for p in (sidecar.with_suffix(""), sidecar.with_suffix(".so")) if p.is_file()), None)
        if made is None:
            continue
        t0 = time.perf_counter()
        same = file_digest(made) == sidecar.read_text()
        timed[made.name] = {"mb": made.stat().st_size / 1e6, "seconds": time.perf_counter() - t0, "same": same}
    return timed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specdec_core.bench.startup", description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the first")
    ap.add_argument("--json", default="startup.json")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a start may take")
    ap.add_argument("--keep", action="store_true", help="keep the cache the first start built")
    args = ap.parse_args(argv)
    cache = Path(tempfile.mkdtemp(prefix="specdec-startup-"))
    try:
        first = start(cache, args.limit)
        print(f"first start: {first['seconds']:.1f} s, {first['cache_mb']:.0f} MB of cache, "
              f"{first['resident_mb']:.0f} MB resident", flush=True)
        warm = []
        for _ in range(args.warm):
            warm.append(start(cache, args.limit))
            print(f"warm start: {warm[-1]['seconds']:.1f} s, {warm[-1]['resident_mb']:.0f} MB resident", flush=True)
        checked = checks(cache)
        print(f"weights checked at every start (SHA-256): {sum(c['mb'] for c in checked.values()):.0f} MB in "
              f"{sum(c['seconds'] for c in checked.values()):.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    report = {"command": "python app.py (bundled pair), until its Ready line", "machine": platform.processor()
              or platform.machine(), "cores": os.cpu_count(), "first": first, "warm": warm, "checks": checked}
    Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
