"""Which model pair the app serves, loading and switching it without ever leaving the app broken."""
from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

from specdec_core import load_pair
from specdec_core.messages import Note, Refusal, cut
from specdec_core.models import LoadOptions, dtype_name
from specdec_core.models.load import release_freed_memory
from specdec_core.models.sources import is_gguf, is_local
from specdec_core.theory import expected_speedup

from .i18n import Said, said, t

PRESETS = {
    "Bundled: Qwen2.5-Coder 1.5B ← 0.5B (offline, CPU)": "bundled",
    "Qwen2.5-7B-Instruct ← Qwen2.5-0.5B-Instruct (GPU)": "Qwen/Qwen2.5-7B-Instruct,Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B-Instruct ← Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct",
    "SmolLM2-1.7B-Instruct ← SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-1.7B-Instruct,HuggingFaceTB/SmolLM2-135M-Instruct",
    "Tiny random pair (instant; gibberish, for trying the UI)": "tiny",
}
class Weights(NamedTuple):
    """The target's weights, said in the visitor's language: a dtype, or int8 (exact), and whether prepacked."""
    kind: str
    prepacked: bool

    def text(self, lang: str) -> str:
        kind = t("weights_int8", lang) if self.kind == "int8" else self.kind
        if self.kind.startswith(("blocks:", "q8_0:")):
            way, _, kernel = self.kind.partition(":")
            kind = t(f"weights_{way}", lang, kernel=kernel)
        return kind + (t("weights_prepacked", lang) if self.prepacked else "")


MEMORY_BUDGET_GB = float(os.environ.get("SPECDEC_MEMORY_BUDGET_GB", "40"))  # largest pair (weights) we agree to load
# hosted: a pair is loaded at most this often (a load costs seconds of every core, and a visitor may not buy them at will)
LOAD_EVERY_S = float(os.environ.get("SPECDEC_LOAD_EVERY_S", "120"))


def parse_spec(spec: str) -> tuple[str, str | None]:
    spec = (spec or "").strip()
    if spec in ("bundled", "tiny"):
        return spec, None
    target, sep, draft = spec.partition(",")
    if not sep or not target.strip() or not draft.strip():
        raise Said("pair_format")
    return target.strip(), draft.strip()


def judge_model_info(model_id: str, info, budget_bytes: float) -> Said | None:
    """Why a hub model must not be loaded (from its metadata, before any download), or None."""
    config = getattr(info, "config", None) or {}
    if getattr(info, "gated", False) and not os.environ.get("HF_TOKEN"):
        return Said("model_gated", model=model_id)
    if config.get("auto_map"):
        return Said("model_remote_code", model=model_id)
    archs = config.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        return Said("model_not_causal", model=model_id, archs=", ".join(archs) or "?")
    files = [s for s in (getattr(info, "siblings", None) or []) if s.rfilename.endswith(".safetensors")]
    if not files:
        return Said("model_no_safetensors", model=model_id)
    size = sum(s.size or 0 for s in files)
    if size > budget_bytes:
        return Said("model_too_big", model=model_id, gb=size / 1e9, budget=budget_bytes / 1e9)
    return None


def check_model_id(model_id: str, budget_bytes: float, local: bool = False) -> None:
    """Validate a hub id, or with `local` a server directory, before anything downloads; ValueError with the
    reason. Without `local` the file system is never looked at, so no answer tells which server paths exist."""
    path = Path(model_id).expanduser()
    if local and path.is_dir():
        if not (path / "config.json").exists() or not list(path.glob("*.safetensors")):
            raise Said("model_not_dir", model=model_id)
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = HfApi().model_info(model_id, files_metadata=True)
    except GatedRepoError:
        raise Said("model_gated", model=model_id) from None
    except RepositoryNotFoundError:
        raise Said("model_not_found", model=model_id) from None
    except Exception as err:  # offline, DNS, timeouts
        raise Said("hub_unreachable", model=model_id, error=err.__class__.__name__) from None
    reason = judge_model_info(model_id, info, budget_bytes)
    if reason:
        raise reason


class PairManager:
    """Holds the current pair. A load that fails leaves the previous pair serving; running generations
    keep the pair object they started with, so a switch never corrupts them."""

    def __init__(self, device: str = "auto", dtype: str = "auto", allow_custom: bool = True,
                 allowlist: frozenset[str] = frozenset(), graphs: str = "auto", probe: bool = True,
                 target_quant: str = "auto", allow_local: bool = False):
        # checked now: an operator's wrong option fails at start, not at a visitor's first load
        self.options = LoadOptions(device=device, dtype=dtype, graphs=graphs, target_quant=target_quant,
                                   budget_gb=MEMORY_BUDGET_GB)
        self.probe = probe
        self.allow_custom, self.allowlist, self.allow_local = allow_custom, allowlist, allow_local
        self.pair = None
        self.spec = None
        self.says: list[tuple[str, dict]] = [("status_none", {})]  # the status: text keys and their values
        self.serving: list[tuple[str, dict]] = []  # what the status said when the pair now served was loaded
        self.failed = False  # the status reports a failed load (shown as an error)
        self.loading = False
        self.loaded_at = -float("inf")  # when the last load began (time.monotonic)
        self.prefill_s_per_token = None  # a prompt's measured cost, a token of one model (handlers: what a prompt will take)
        self._lock = threading.Lock()

    def say(self, key: str, **values) -> None:
        self.says = [(key, {name: cut(v, 200) if isinstance(v, str) and not isinstance(v, Note) else v
                            for name, v in values.items()})]

    def status_text(self, lang: str = "en") -> str:
        def shown(value):  # the weights, a refusal and a load's progress in the page's language; names as they are
            if isinstance(value, Weights):
                return value.text(lang)
            if isinstance(value, Note):
                return t(value.key, lang, **value.values)
            return said(value, lang) if isinstance(value, Refusal) else value
        return "".join(t(key, lang, **{name: shown(v) for name, v in values.items()}) for key, values in self.says)

    @property
    def status(self) -> str:
        """The status in English: for the terminal, logs and the API."""
        return self.status_text("en")

    def _progress(self, fraction: float, message: str) -> None:
        self.say("status_progress", message=message, fraction=fraction)

    def check_allowed(self, spec: str) -> tuple[str, str | None]:
        """In hosted mode a preset ("bundled", "tiny") or each id of a custom pair must be listed."""
        target, draft = parse_spec(spec)
        if not self.allow_custom:
            for model_id in (target,) if draft is None else (target, draft):
                if model_id not in self.allowlist:
                    raise Said("pair_not_listed", model=model_id)
        return target, draft

    def load(self, spec: str, local: bool | None = None) -> str:
        """Load `spec` and make it current; returns a status line. Never raises. `local`: server directories may be
        loaded (default: as the operator allowed; the pair the operator starts with always may)."""
        local = self.allow_local if local is None else local
        if not self._lock.acquire(blocking=False):
            return t("status_busy")
        if self.pair is not None and not self.failed and (spec or "").strip() == self.spec:
            self._lock.release()
            return self.status  # the pair it serves: nothing to load
        self.loading, self.failed = True, False
        try:
            target, draft = self.check_allowed(spec)
            wait = self.loaded_at + LOAD_EVERY_S - time.monotonic()
            if not self.allow_custom and self.pair is not None and wait > 0:
                raise Said("load_wait", s=wait)
            self.loaded_at = time.monotonic()
            if draft is not None and not local and any(map(is_local, (target, draft))):
                raise Said("gguf_local_off")  # said before the disk is looked at: no answer tells what it holds
            if draft is not None and not (is_gguf(target) or is_gguf(draft)):  # GGUF names: load_pair checks them
                for model_id in (target, draft):
                    self.say("status_checking", model=model_id)
                    check_model_id(model_id, MEMORY_BUDGET_GB * 1e9, local)
            t0 = time.perf_counter()
            pair = load_pair(target, draft, self.options, progress=self._progress)
            seconds = time.perf_counter() - t0
            verdict = self.gpu_verdict(pair) if self.probe and pair.device.type == "cuda" else []
            old, self.pair, self.spec = self.pair, pair, spec.strip()
            if old is not None:  # its memory back to the system, once no race holds it
                del old
                gc.collect()
                release_freed_memory()
            dtype = dtype_name(pair.dtype)
            info = pair.info
            self.says = [("status_ready", dict(target=info.target, draft=info.draft, device=pair.device,
                                               weights=Weights(info.target_weights or dtype, info.target_prepacked),
                                               draft_weights=info.draft_quant or dtype, seconds=seconds))]
            self.says += verdict
            self.serving = self.says
        except Exception as err:  # a failed load must leave the app serving the previous pair
            plain = isinstance(err, (ValueError, RuntimeError, OSError))  # a library's own message, as it said it
            reason = err if isinstance(err, Refusal) else cut(str(err) if plain else repr(err), 300)
            self.failed = True  # the failure replaces the status; the pair still served is said as when it loaded
            self.says = [("status_failed", dict(spec=cut(spec), reason=reason))] + (
                [("status_still", {}), *self.serving] if self.pair is not None else [])
        finally:
            self.loading = False
            self._lock.release()
        print(self.status, flush=True)  # the terminal that started the app sees it too
        return self.status

    @staticmethod
    def gpu_verdict(pair, a: float = 0.8, k: int = 4) -> list[tuple[str, dict]]:
        """Whether drafting pays on this GPU, from the draft's and the verify pass's costs timed here (Pair.costs: kept
        for the races)."""
        costs = pair.costs()
        gain = expected_speedup(a, k, costs.draft, costs.verify(k + 1))
        words = [("status_gpu", dict(c=costs.draft, a=a, gain=gain, k=k))]
        return words + [("status_gpu_small", {})] if gain < 1.2 else words

    def load_in_background(self, spec: str) -> threading.Thread:
        self.spec, self.failed = spec, False
        self.say("status_loading", spec=spec)
        thread = threading.Thread(target=self.load, args=(spec, True), daemon=True)  # the operator's own pair
        thread.start()
        return thread
