"""Where a GGUF model named by a user lies: a file's path, an Ollama model, or a quantisation in a Hub repository.

- `path/to/model.gguf`: the file; the first of a model split by gguf-split (`name-00001-of-00003.gguf`) brings the rest.
- `ollama:NAME[:TAG]`: the model blob an Ollama manifest names (`$OLLAMA_MODELS`, else ~/.ollama/models).
- `OWNER/REPO:QUANT`: the repository's GGUF file(s) of that quantisation (`q4_k_m`, ...), downloaded once by
  huggingface_hub into its cache, or found there when the Hub is offline.

A path or an Ollama name reads the server's disk: the app allows them only with --local-models.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..messages import Refusal

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
HUB = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>[\w.-]+)$")
OLLAMA_HOSTS = ("registry.ollama.ai", "ollama.com")
OLLAMA_MODEL = "application/vnd.ollama.image.model"


def is_gguf(name: str) -> bool:
    """Whether `name` names a GGUF model (a path ending in .gguf, an Ollama name, or a Hub repository's quant)."""
    name = name.strip()
    return name.lower().endswith(".gguf") or name.startswith("ollama:") or HUB.match(name) is not None


def is_local(name: str) -> bool:
    """Whether `name` reads the server's own files (a path or an Ollama name), not the Hub's."""
    return is_gguf(name) and HUB.match(name.strip()) is None


def gguf_files(name: str, budget_bytes: float = float("inf")) -> tuple[Path, list[Path]]:
    """(the model's first file, the other files it is split into), or a Refusal that says why there are none."""
    name = name.strip()
    if name.startswith("ollama:"):
        return ollama_blob(name.removeprefix("ollama:")), []
    hub = HUB.match(name)
    paths = hub_files(hub["repo"], hub["quant"], budget_bytes) if hub else [Path(name).expanduser()]
    return paths[0], shards_of(paths[0])


def shards_of(first: Path) -> list[Path]:
    """The other files of a model split by gguf-split, in order, from its first; [] for a whole file."""
    if not first.is_file():
        raise Refusal("gguf_missing", path=str(first))
    split = SPLIT.match(first.name)
    if split is None:
        return []
    if int(split["no"]) != 1:
        raise Refusal("gguf_not_first", path=first.name)
    count = int(split["count"])
    rest = [first.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
    missing = [p.name for p in rest if not p.is_file()]
    if missing:
        raise Refusal("gguf_missing", path=", ".join(missing[:3]))
    return rest


def ollama_blob(name: str, root: Path | None = None) -> Path:
    """The GGUF blob of Ollama's `name[:tag]` (tag "latest" by default): its manifest's model layer."""
    root = Path(root or os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if not model or len(parts) > 3 or any(p in ("", ".", "..") for p in parts) or "/" in tag or tag in (".", ".."):
        raise Refusal("ollama_name", name=name)
    # library/NAME, USER/NAME, or HOST/USER/NAME, as Ollama lays out its manifests
    places = [Path(*parts)] if len(parts) == 3 else [Path(host, *(["library"] if len(parts) == 1 else []), *parts)
                                                     for host in OLLAMA_HOSTS]
    for place in places:
        manifest = root / "manifests" / place / (tag or "latest")
        if manifest.is_file():
            break
    else:
        raise Refusal("ollama_missing", name=name, root=str(root))
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL)
    except (ValueError, AttributeError, KeyError, TypeError, StopIteration):
        raise Refusal("ollama_manifest", name=name) from None
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(digest)):
        raise Refusal("ollama_manifest", name=name)
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise Refusal("gguf_missing", path=str(blob))
    return blob


def quant_of(filename: str, quant: str) -> bool:
    """Whether a repository's file is a GGUF of quantisation `quant` (named as a word of its file name)."""
    stem = Path(filename).name.lower()
    return stem.endswith(".gguf") and re.search(rf"(^|[-_.]){re.escape(quant.lower())}([-_.]|$)", stem) is not None


def pick_quant(files: list[str], repo: str, quant: str) -> list[str]:
    """The one model of `quant` among a repository's files: a whole file, or the parts of a split one (first first)."""
    chosen = sorted(f for f in files if quant_of(f, quant))
    models = {SPLIT.sub(r"\g<stem>", f) for f in chosen}  # a split model's parts: one model
    if not chosen:
        raise Refusal("hub_no_quant", repo=repo, quant=quant)
    if len(models) > 1:
        raise Refusal("hub_quant_ambiguous", repo=repo, quant=quant, files=", ".join(sorted(models)[:4]))
    return chosen


def hub_files(repo: str, quant: str, budget_bytes: float) -> list[Path]:
    """The quant's files in the Hub's cache, downloaded there first where they are not, within the memory budget."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except GatedRepoError:
        raise Refusal("hub_gguf_gated", repo=repo) from None
    except RepositoryNotFoundError:
        raise Refusal("hub_gguf_not_found", repo=repo) from None
    except Exception:  # offline, DNS, timeouts: what the Hub's cache holds
        try:
            folder = Path(snapshot_download(repo, allow_patterns=["*.gguf"], local_files_only=True))
        except Exception:
            raise Refusal("hub_gguf_offline", repo=repo) from None
        files = pick_quant([p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")], repo, quant)
        return [folder / f for f in files]
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    files = pick_quant(list(sizes), repo, quant)
    size = sum(sizes[f] for f in files)
    if size > budget_bytes:
        raise Refusal("gguf_too_big", name=f"{repo}:{quant}", gb=size / 1e9, budget=budget_bytes / 1e9)
    folder = Path(snapshot_download(repo, allow_patterns=files))
    return [folder / f for f in files]
