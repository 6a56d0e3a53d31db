"""Which model pair the app serves, loading and switching it without ever leaving the app broken."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from specdec_core import load_pair
from specdec_core.theory import expected_speedup
from specdec_core.timing import probe_costs

from .i18n import t

PRESETS = {
    "Bundled: Qwen2.5-Coder 1.5B ← 0.5B (offline, CPU)": "bundled",
    "Qwen2.5-7B-Instruct ← Qwen2.5-0.5B-Instruct (GPU)": "Qwen/Qwen2.5-7B-Instruct,Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B-Instruct ← Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct",
    "SmolLM2-1.7B-Instruct ← SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-1.7B-Instruct,HuggingFaceTB/SmolLM2-135M-Instruct",
    "Tiny random pair (instant; gibberish, for trying the UI)": "tiny",
}
MEMORY_BUDGET_GB = float(os.environ.get("SPECDEC_MEMORY_BUDGET_GB", "40"))  # largest pair (weights) we agree to load


def parse_spec(spec: str) -> tuple[str, str | None]:
    spec = (spec or "").strip()
    if spec in ("bundled", "tiny"):
        return spec, None
    target, sep, draft = spec.partition(",")
    if not sep or not target.strip() or not draft.strip():
        raise ValueError("A custom pair is written TARGET_ID,DRAFT_ID (for example "
                         "Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct).")
    return target.strip(), draft.strip()


def judge_model_info(model_id: str, info, budget_bytes: float) -> str | None:
    """Why a hub model must not be loaded (from its metadata, before any download), or None."""
    config = getattr(info, "config", None) or {}
    if getattr(info, "gated", False) and not os.environ.get("HF_TOKEN"):
        return f"{model_id} is gated: accept its licence on the Hub and set HF_TOKEN."
    if config.get("auto_map"):
        return f"{model_id} needs custom (remote) code, which this app never runs."
    archs = config.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        return f"{model_id} is not a causal language model (architectures: {', '.join(archs) or 'unknown'})."
    files = [s for s in (getattr(info, "siblings", None) or []) if s.rfilename.endswith(".safetensors")]
    if not files:
        return f"{model_id} ships no safetensors weights; pickle weights are never loaded."
    size = sum(s.size or 0 for s in files)
    if size > budget_bytes:
        return f"{model_id} has {size / 1e9:.1f} GB of weights, over this server's budget of {budget_bytes / 1e9:.0f} GB."
    return None


def check_model_id(model_id: str, budget_bytes: float) -> None:
    """Validate a hub id or local directory before anything downloads; ValueError with the reason."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() or not list(path.glob("*.safetensors")):
            raise ValueError(f"{model_id} is not a model directory with config.json and safetensors weights.")
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = HfApi().model_info(model_id, files_metadata=True)
    except GatedRepoError:
        raise ValueError(f"{model_id} is gated: accept its licence on the Hub and set HF_TOKEN.") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{model_id} does not exist on the Hub, or is private.") from None
    except Exception as err:  # offline, DNS, timeouts
        raise ValueError(f"Could not reach the Hugging Face Hub to check {model_id} ({err.__class__.__name__}). "
                         "Offline, only the bundled and tiny pairs are available.") from None
    reason = judge_model_info(model_id, info, budget_bytes)
    if reason:
        raise ValueError(reason)


class PairManager:
    """Holds the current pair. A load that fails leaves the previous pair serving; running generations
    keep the pair object they started with, so a switch never corrupts them."""

    def __init__(self, device: str = "auto", dtype: str = "auto", allow_custom: bool = True,
                 allowlist: frozenset[str] = frozenset(), graphs: str = "auto", probe: bool = True,
                 target_quant: str = "auto"):
        self.device, self.dtype, self.graphs, self.probe, self.target_quant = device, dtype, graphs, probe, target_quant
        self.allow_custom, self.allowlist = allow_custom, allowlist
        self.pair = None
        self.spec = None
        self.says: list[tuple[str, dict]] = [("status_none", {})]  # the status: text keys and their values
        self.failed = False  # the status reports a failed load (shown as an error)
        self.loading = False
        self._lock = threading.Lock()

    def say(self, key: str, **values) -> None:
        self.says = [(key, values)]

    def status_text(self, lang: str = "en") -> str:
        return "".join(t(key, lang, **values) for key, values in self.says)

    @property
    def status(self) -> str:
        """The status in English: for the terminal, logs and the API."""
        return self.status_text("en")

    def _progress(self, fraction: float, message: str) -> None:
        self.say("status_progress", message=message, fraction=fraction)

    def check_allowed(self, spec: str) -> tuple[str, str | None]:
        target, draft = parse_spec(spec)
        if draft is not None and not self.allow_custom:
            for model_id in (target, draft):
                if model_id not in self.allowlist:
                    raise ValueError(f"This server only serves its listed pairs; {model_id} is not among them.")
        return target, draft

    def load(self, spec: str) -> str:
        """Load `spec` and make it current; returns a status line. Never raises."""
        if not self._lock.acquire(blocking=False):
            return t("status_busy")
        self.loading, self.failed = True, False
        previous = self.says if self.pair is not None else []
        try:
            target, draft = self.check_allowed(spec)
            if draft is not None:
                for model_id in (target, draft):
                    self.say("status_checking", model=model_id)
                    check_model_id(model_id, MEMORY_BUDGET_GB * 1e9)
            t0 = time.perf_counter()
            pair = load_pair(target, draft, device=self.device, dtype=self.dtype, progress=self._progress,
                             graphs=self.graphs, target_quant=self.target_quant)
            seconds = time.perf_counter() - t0
            verdict = self.gpu_verdict(pair) if self.probe and pair.device.type == "cuda" else []
            self.pair, self.spec = pair, spec
            dtype = str(pair.dtype).replace("torch.", "")
            self.says = [("status_ready", dict(target=pair.info.get("target"), draft=pair.info.get("draft"),
                                               device=pair.device, weights=pair.info.get("target_weights", dtype),
                                               draft_weights=pair.info.get("draft_quant", dtype), seconds=seconds))]
            self.says += verdict
        except Exception as err:  # a failed load must leave the app serving the previous pair
            reason = str(err) if isinstance(err, (ValueError, RuntimeError, OSError)) else repr(err)
            self.failed = True
            self.says = [("status_failed", dict(spec=spec, reason=reason))] + (
                [("status_still", {}), *previous] if previous else [])
        finally:
            self.loading = False
            self._lock.release()
        print(self.status, flush=True)  # the terminal that started the app sees it too
        return self.status

    @staticmethod
    def gpu_verdict(pair, a: float = 0.8) -> list[tuple[str, dict]]:
        """Whether drafting pays on this GPU, from the draft's and the verify pass's costs timed here."""
        costs = probe_costs(pair)
        gain = expected_speedup(a, costs["k"], costs["c"], costs["v"])
        pair.info["costs"] = costs
        words = [("status_gpu", dict(c=costs["c"], a=a, gain=gain, k=costs["k"]))]
        return words + [("status_gpu_small", {})] if gain < 1.2 else words

    def load_in_background(self, spec: str) -> threading.Thread:
        self.spec, self.failed = spec, False
        self.say("status_loading", spec=spec)
        thread = threading.Thread(target=self.load, args=(spec,), daemon=True)
        thread.start()
        return thread
