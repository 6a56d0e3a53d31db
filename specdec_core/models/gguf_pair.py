"""A pair of GGUF files made into a Pair: the bundled one, or files a user names (sources.py).

The target computes exactly on its file's blocks (gguf_model.load_target), or on its values (int8 on CPUs without
AVX2 or a C compiler, made by load.py); the draft's values are read to be quantised. The tokenizer is made from the target's
own metadata and kept in the cache with the digest of its files.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..messages import Note, Refusal
from .files import default_cache_dir, file_digest, identity
from .gguf_file import GGUF
from .gguf_model import load_dense, load_target
from .kernels.native import locked, remove_leftovers
from .pair import Pair, PairInfo, Progress, dtype_name, make_pair
from .sources import gguf_files, is_gguf

MANIFEST = "specdec.json"


def digests(folder: Path) -> dict:
    return {f.name: file_digest(f) for f in sorted(folder.iterdir()) if f.name != MANIFEST}


def tokenizer_of(gguf: GGUF, root: Path, key: str):
    """The tokenizer made from the file's metadata (transformers' conversion, a second), kept in the cache under `key`
    with the digest of its files; a folder whose files do not match it is made again."""
    from transformers import PreTrainedTokenizerFast

    folder = root / f"tokenizer-{key[:16]}"
    try:
        if json.loads((folder / MANIFEST).read_text()) == digests(folder):
            return PreTrainedTokenizerFast.from_pretrained(folder)
    except (OSError, ValueError):
        pass
    with locked(root), tempfile.TemporaryDirectory(dir=root) as tmp:
        # transformers reads the tokenizer from a file: the metadata alone, without the tensors, is enough
        header = Path(tmp) / "tokenizer.gguf"
        header.write_bytes(gguf.metadata)
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=header.name)
        except (ValueError, KeyError, TypeError) as err:
            raise Refusal("gguf_unreadable", name=gguf.name, why=f"its tokenizer: {err}") from None
        building = folder.with_name(folder.name + ".partial")
        shutil.rmtree(building, ignore_errors=True)
        tok.save_pretrained(building)
        (building / MANIFEST).write_text(json.dumps(digests(building)))
        shutil.rmtree(folder, ignore_errors=True)
        building.rename(folder)
    return tok


def opened(first: Path, shards: list[Path], name: str) -> GGUF:
    """The file read as a model of an architecture read here, or a Refusal that says why it is not one."""
    try:
        f = GGUF(first, shards)
        f.config()
        return f
    except (ValueError, KeyError, TypeError, struct.error, OverflowError) as err:
        raise Refusal("gguf_unreadable", name=name, why=str(err) or err.__class__.__name__) from None


def load_files(name: str, target: GGUF, draft: GGUF, names: tuple[str, str], device: torch.device, dtype: torch.dtype,
               progress: Progress, root: Path, key: str, exact: bool = True,
               lazy: tuple[bool, bool] = (False, False)) -> Pair:
    """The pair read from its files: the target exact on its blocks (exact=False: its values in `dtype`), the draft's
    values in `dtype`. lazy: (target, draft) left in the files until they are quantised (gguf_model.load_dense; CPUs
    only). The tokenizer, under `key` in the cache `root`, is made (first start) or checked on a thread beside."""
    # the tokens and their merges: two files may differ in their special ids (an instruct target's end of turn, a base
    # draft's end of text) and still split every text into the same tokens
    if target.vocabulary()[:2] != draft.vocabulary()[:2]:
        raise Refusal("tokenizers_differ", draft=repr(names[1]), target=repr(names[0]))
    with ThreadPoolExecutor(1) as pool:
        tok = pool.submit(tokenizer_of, target, root, key)
        progress(0.3, Note("load_reading", model=names[0]))
        target_model = load_target(target) if exact else load_dense(target, dtype, lazy[0])
        progress(0.6, Note("load_reading", model=names[1]))
        draft_model = load_dense(draft, dtype, lazy[1])
        progress(0.8, Note("load_tokenizer"))
        tok = tok.result()
    if device.type != "cpu":
        target_model, draft_model = target_model.to(device), draft_model.to(device)
    return make_pair(name, target_model, draft_model, tok, device, dtype, PairInfo(*names))


def load_named(target: str, draft: str, device: torch.device, dtype: torch.dtype, progress: Progress,
               cache_dir=None, exact: bool = True, lazy: tuple[bool, bool] = (False, False),
               budget_bytes: float = float("inf")) -> tuple[Pair, dict]:
    """The pair of GGUF models a user names (sources.py), and where its draft's quantised weights are kept:
    {"draft": (file, source)}. The target's int8 weights, where it has them, are made at each load: the size of the
    model, they would double what the cache holds."""
    if not (is_gguf(target) and is_gguf(draft)):
        raise Refusal("gguf_pair_mixed", target=target, draft=draft)
    root = Path(cache_dir or default_cache_dir())
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    remove_leftovers(root)
    shown = [Path(name).name if name.lower().endswith(".gguf") else name for name in (target, draft)]
    progress(0.05, Note("load_reading", model=shown[0]))
    files = [gguf_files(name, budget_bytes) for name in (target, draft)]
    size = sum(p.stat().st_size for first, shards in files for p in [first, *shards])
    if size > budget_bytes:
        raise Refusal("gguf_too_big", name=" + ".join(shown), gb=size / 1e9, budget=budget_bytes / 1e9)
    t, d = (opened(first, shards, name) for (first, shards), name in zip(files, shown))
    # the tokenizer kept by the metadata it is made from; the draft's quantised weights by the file as it is now (a
    # file changed or replaced gets a key of its own); the pair named by the names shown, never a server's paths
    pair = load_files(" <- ".join(shown), t, d, tuple(shown), device, dtype, progress, root,
                      hashlib.sha256(t.metadata).hexdigest(), exact, lazy)
    draft_key = hashlib.sha256(repr(identity([files[1][0], *files[1][1]])).encode()).hexdigest()
    return pair, {"draft": (root / f"gguf-{draft_key[:16]}-int4-{dtype_name(dtype)}.safetensors", draft_key)}
