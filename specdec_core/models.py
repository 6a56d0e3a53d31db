"""Model pairs: the bundled offline pair, a tiny random pair, or hub ids / local directories."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

Progress = Callable[[float, str], None]  # (fraction done, message)


@dataclass
class Pair:
    name: str
    target: torch.nn.Module
    draft: torch.nn.Module | None  # None: only model-free drafters (prompt lookup, early exit)
    tokenizer: object
    vocab: int  # the shared tokenizer range; logits rows past it (vocab padding) are ignored
    eos_ids: frozenset[int]
    context_length: int
    device: torch.device
    dtype: torch.dtype
    info: dict = field(default_factory=dict)  # target / draft names, parameter counts, load time


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware runs it natively (CUDA, CPUs with AVX512-BF16/AMX), else
    float16 on MPS, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids if i is not None)


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab() or target_tok.all_special_tokens != draft_tok.all_special_tokens:
        raise ValueError(f"The draft {draft_name!r} and the target {target_name!r} use different tokenizers; "
                         "speculative decoding needs both to share one vocabulary.")


def make_pair(name, target, draft, tokenizer, device, dtype, info=None) -> Pair:
    rows = [target.get_output_embeddings().weight.shape[0]]
    if draft is not None:
        rows.append(draft.get_output_embeddings().weight.shape[0])
    vocab = min(len(tokenizer), *rows)
    ctx = getattr(target.config, "max_position_embeddings", None) or 4096
    info = dict(info or {})
    info["target_params"] = sum(p.numel() for p in target.parameters())
    info["draft_params"] = sum(p.numel() for p in draft.parameters()) if draft is not None else 0
    from .cache import share_head
    from .text import template_head

    head = template_head(tokenizer)  # every prompt's chat-template head is computed once per model
    for model in (target, draft):
        if model is not None:
            share_head(model, head)
    return Pair(name, target.eval(), draft.eval() if draft is not None else None, tokenizer, vocab,
                eos_ids_of(target, tokenizer), int(ctx), device, dtype, info)


def load_pair(target: str = "bundled", draft: str | None = None, device: str = "auto", dtype: str = "auto",
              progress: Progress | None = None, cache_dir: str | os.PathLike | None = None,
              draft_quant: bool | str = "auto", pack: bool | str = "auto", quant_mode: str = "int4",
              graphs: str = "auto", max_len: int = 4096) -> Pair:
    """"bundled" (offline default), "tiny" (random, for tests), or a target and draft hub id / local dir.

    "auto" (see quant.py for the measurements):
    draft_quant: a quantised draft on CPUs (quant_mode: see quant.cheapen_draft). It changes the
    draft's speed and guesses, never the output.
    pack: on CPUs in bfloat16, every remaining Linear weight prepacked for oneDNN (same numbers, faster).
    graphs: on CUDA, decoding steps compiled with CUDA graphs ("inductor"; also "cudagraphs", "off") over
    static caches of `max_len` positions (cache.StaticSteps); the context is capped to fit them.
    """
    progress = progress or (lambda f, m: None)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    backend = ("inductor" if dev.type == "cuda" else "off") if graphs == "auto" else graphs
    if backend not in ("off", "inductor", "cudagraphs"):
        raise ValueError(f"graphs must be auto, off, inductor or cudagraphs, got {graphs!r}")
    if target == "tiny":
        from .tiny import tiny_models
        t, d, tok = tiny_models()
        progress(1.0, "tiny pair ready")
        return make_pair("tiny", t.to(dev, dt), d.to(dev, dt), tok, dev, dt,
                         {"target": "tiny-target", "draft": "tiny-draft (perturbed copy)"})
    if target == "bundled":
        from .bundled import load_bundled
        pair = load_bundled(dev, dt, progress, cache_dir)
    elif draft is None:
        raise ValueError("A custom pair needs both a target and a draft model id (or directory).")
    else:
        pair = load_hub_pair(target, draft, dev, dt, progress)
    from .quant import can_pack, cheapen_draft, pack_linears, quant_label

    cpu_bf16 = dev.type == "cpu" and dt == torch.bfloat16
    # the bundled draft keeps its quantised weights beside its own, with the manifest of the weights they came from
    quant_dir, source = pair.info.pop("quant_dir", None), pair.info.pop("quant_source", "")
    if pair.draft is not None and (draft_quant is True or (draft_quant == "auto" and dev.type == "cpu")):
        saved = Path(quant_dir) / f"draft-{quant_mode}.safetensors" if quant_dir else None
        cheapen_draft(pair.draft, quant=True, mode=quant_mode, saved=saved, source=source)
        pair.info["draft_quant"] = quant_label(pair.draft, quant_mode)
    if pack is True or (pack == "auto" and cpu_bf16):
        for model in (pair.target, pair.draft):
            if model is not None and can_pack(model):
                pack_linears(model)
                pair.info["packed"] = "oneDNN prepacked weights"
    if backend != "off":
        enable_graphs(pair, backend, max_len, progress)
    return pair


def enable_graphs(pair: Pair, backend: str, max_len: int, progress: Progress | None = None) -> None:
    """Compile both models' decoding steps now, for the sizes a default round uses, so that the
    first run does not stop to compile (on a 7B-shaped target on an H200: minutes)."""
    from .cache import STEP_SIZES, CachedModel, compile_steps

    progress = progress or (lambda f, m: None)

    # a default round scores up to DEFAULT_K + 1 tokens (padded to 32); a draft step feeds one or two
    for model, sizes in ((pair.target, STEP_SIZES), (pair.draft, STEP_SIZES[:2])):
        if model is None:
            continue
        compile_steps(model, max_len, backend)
        lm = CachedModel(model, pair.vocab)
        lm.prefill([0] * 8)
        for n in sizes:
            progress(0.95, f"compiling decoding steps ({backend}): {n} token(s)")
            lm.forward(torch.zeros(n, dtype=torch.long, device=lm.device), keep=1)
            lm.crop(8)
    pair.context_length = min(pair.context_length, max_len - STEP_SIZES[-1])
    pair.info["graphs"] = f"compiled steps ({backend}), static caches of {max_len} positions"


def load_hub_pair(target_id: str, draft_id: str, device: torch.device, dtype: torch.dtype,
                  progress: Progress) -> Pair:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(model_id, placement):
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, device_map=placement,
                                                    use_safetensors=True, trust_remote_code=False)

    progress(0.05, f"loading tokenizers of {target_id} and {draft_id}")
    tok = AutoTokenizer.from_pretrained(target_id, trust_remote_code=False)
    draft_tok = AutoTokenizer.from_pretrained(draft_id, trust_remote_code=False)
    check_tokenizers(tok, draft_tok, target_id, draft_id)  # fail before loading gigabytes of weights
    progress(0.1, f"loading target {target_id}")
    # accelerate spreads a target too large for one GPU over all of them; the draft follows its first device
    target = load(target_id, "auto" if device.type == "cuda" else str(device))
    first = target.get_input_embeddings().weight.device
    progress(0.7, f"loading draft {draft_id}")
    draft = load(draft_id, str(first))
    progress(1.0, "ready")
    return make_pair(f"{target_id} <- {draft_id}", target, draft, tok, first, dtype,
                     {"target": target_id, "draft": draft_id})


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
