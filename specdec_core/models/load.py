"""load_pair: the bundled offline pair, a tiny random pair, or hub ids / local directories."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace

import torch

from ..cache import PADDED_SIZES, CompiledForward, padded_size
from ..config import MAX_GUESS, TARGET_QUANTS
from ..messages import Note, Refusal
from .attention import GROUPED, ROWS
from .kernels import int4_vnni
from .kernels.kquant import library as kquant_library
from .pair import Pair, PairInfo, Progress, check_tokenizers, dtype_name, dtype_named, make_pair, pick_device, pick_dtype
from .quant import fits_blocks
from .sources import is_gguf
from .step import DraftStep, TargetForward


@dataclass(frozen=True)
class LoadOptions:
    """How load_pair loads a pair, checked when made, as SpecConfig is for generation ("auto": docs/benchmarks.md has
    the measurements).

    target_quant: how the target computes on CPUs, exact in "auto", "int8" and "blocks": a position's logits are the
    same, bit for bit, in a one-token step and in any verification pass, so greedy speculative output is plain
    decoding's on every prompt. "auto" on CPUs: "blocks" where the CPU has AVX-512 VNNI or AVX2, else "int8"
    (auto_target_quant); the tiny test pair runs as built. "blocks": a GGUF target (the bundled one, or one named as
    sources.py reads names) on its file's own blocks (kernels/kquant.py): nothing to convert at start, and fewer bytes
    read a step; a Hub target on Q8_0 blocks made from its values at load (where its shapes fit them, else int8).
    "int8" (int8.TokenInt8Linear): int8 weights made from the target's values (for the bundled pair, once, kept in
    the cache). "off": the values as loaded, in `dtype` (bfloat16 on most CPUs: near-ties can part the two outputs).
    draft_quant: an int4 draft on CPUs (quant.draft_to_int4; int8 where the int4 product does not fit). It changes the
    draft's speed and guesses, never the output.
    graphs: on CUDA, decoding steps compiled with CUDA graphs ("inductor", or "off") over static caches
    of `max_len` positions (cache.CompiledForward); the context is capped to fit them.
    one_shape: with graphs, every decoding forward of the target is fed at PADDED_SIZES[-1] rows, one-token steps too
    (cache.CompiledForward's width), so that a position's logits are the same bits in a step and in a chain's pass.
    budget_gb: the most gigabytes of GGUF files a named pair may take (None: any)."""
    device: str = "auto"
    dtype: str = "auto"
    target_quant: str = "auto"
    draft_quant: bool | str = "auto"
    graphs: str = "auto"
    max_len: int = 4096
    cache_dir: str | os.PathLike | None = None
    one_shape: bool = True
    budget_gb: float | None = None

    def __post_init__(self):
        if self.graphs not in ("auto", "off", "inductor"):
            raise ValueError(f"graphs must be auto, off or inductor, got {self.graphs!r}")
        if self.target_quant not in TARGET_QUANTS:
            raise ValueError(f"target_quant must be auto, off, blocks or int8, got {self.target_quant!r}")
        if self.dtype != "auto":
            dtype_named(self.dtype)
        if self.draft_quant not in (True, False, "auto"):
            raise ValueError(f"draft_quant must be True, False or 'auto', got {self.draft_quant!r}")


def load_pair(target: str = "bundled", draft: str | None = None, options: LoadOptions | None = None,
              progress: Progress | None = None, **settings) -> Pair:
    """"bundled" (offline default), "tiny" (random, for tests), a target and draft GGUF model each (a path, an
    Ollama name or a Hub repository's quant: sources.py), or a target and draft hub id / local dir, loaded as
    `options` say (or LoadOptions(**settings))."""
    if options is not None and settings:
        raise TypeError("load_pair takes options or their settings, not both")
    o = options or LoadOptions(**settings)
    progress = progress or (lambda f, m: None)
    dev = pick_device(o.device)
    dt = pick_dtype(o.dtype, dev)
    backend = ("inductor" if dev.type == "cuda" else "off") if o.graphs == "auto" else o.graphs
    quant = o.target_quant
    as_built = target == "tiny"  # the tiny test pair runs as built: tests compare it with models built the same way
    if quant == "auto":
        quant = auto_target_quant(target, dev)
    if quant in ("blocks", "int8") and dev.type != "cpu":
        raise Refusal("cpu_only", value=repr(quant))
    if quant == "blocks" and kquant_library()[0] is None:
        raise Refusal("blocks_no_product", why=kquant_library()[1])
    cheap_draft = (o.draft_quant is True or (o.draft_quant == "auto" and dev.type == "cpu")) and not as_built
    pair, saved = read_models(target, draft, o, quant, cheap_draft, dev, dt, progress)
    if quant == "blocks" and not on_blocks(pair.target) and not fits_blocks(pair.target):
        if o.target_quant == "blocks":
            raise Refusal("blocks_shapes", model=pair.info.target)
        quant = "int8"  # a Hub target of other shapes (inputs not a multiple of 256): int8's products take any
    said = {}  # the PairInfo fields the steps below fill in
    if pair.draft is not None and cheap_draft:
        progress(0.85, Note("load_draft_int4", model=pair.info.draft))  # a first start's longest phase
        said.update(quantise_draft(pair.draft, *saved.get("draft", (None, ""))))
    if pair.draft is not None and dev.type == "cpu" and not as_built:
        # SDPA would repeat the key/value heads over the whole cache every step: a draft step at 1,000 tokens of
        # context would cost nearly twice one at 128 (docs/benchmarks.md); the draft changes only speed
        pair.draft.set_attn_implementation(GROUPED)
        if DraftStep.fits(pair.draft):  # its steps and short prompts written out (step.py)
            pair.written["draft"] = DraftStep(pair.draft)
    said.update(target_weights=dtype_name(dt), target_quant=quant)
    if quant in ("blocks", "int8"):
        said.update(make_exact(pair, quant, saved, progress))
    if dev.type == "cpu":
        said.update(pack_and_release(pair, pack=dt == torch.bfloat16 and not as_built))
    pair = replace(pair, info=replace(pair.info, **said))
    if backend != "off":
        pair = enable_graphs(pair, backend, o.max_len, progress, o.one_shape)
    progress(1.0, Note("load_ready"))
    return pair


def make_exact(pair: Pair, quant: str, saved: dict, progress: Progress) -> dict:
    """The target made exact (the same logits in a step and in a pass): on its blocks, each row's attention as a step
    computes it and every forward written out (step.py), one arithmetic for all; or in int8. Returns what the pair's
    info says of it."""
    from .int8 import TokenInt8Linear
    from .quant import quantise_target, target_on_blocks

    if quant == "blocks":
        own = on_blocks(pair.target)
        if not own:  # a Hub checkpoint's values, made Q8_0 blocks
            target_on_blocks(pair.target)
        pair.target.set_attn_implementation(ROWS)
        if TargetForward.fits(pair.target):
            pair.written["target"] = TargetForward(pair.target)
        return {"target_weights": f"{'blocks' if own else 'q8_0'}:{kquant_library()[1]}"}
    progress(0.9, Note("load_target_int8", model=pair.info.target))
    quantise_target(pair.target, *saved.get("target", (None, "")))
    kernels = {m.kernel for m in pair.target.modules() if isinstance(m, TokenInt8Linear)}
    return {"target_weights": "int8", "target_int8": "/".join(sorted(kernels))}


def read_models(target: str, draft: str | None, o: LoadOptions, quant: str, cheap_draft: bool, dev: torch.device,
                dt: torch.dtype, progress: Progress) -> tuple[Pair, dict]:
    """The pair as read, and for the bundled one where its quantised weights are kept: {role: (file, source)}."""
    if target == "tiny":
        from .tiny import NOMINAL_COSTS, tiny_models
        t, d, tok = tiny_models()
        pair = make_pair("tiny", t.to(dev, dt), d.to(dev, dt), tok, dev, dt,
                         PairInfo("tiny-target", "tiny-draft (perturbed copy)"))
        return replace(pair, pass_costs=NOMINAL_COSTS), {}
    if target == "bundled":
        from .bundled import DRAFT, TARGET, load_bundled
        pair, root = load_bundled(dev, dt, progress, o.cache_dir, exact=quant == "blocks",
                                  lazy=(quant == "int8" and dev.type == "cpu", cheap_draft and dev.type == "cpu"))
        kind = dtype_name(dt)  # weights made from values of another dtype are other weights
        return pair, {"draft": (DRAFT.saved(root, "int4", kind), DRAFT.sha256),
                      "target": (TARGET.saved(root, "int8", kind), TARGET.sha256)}
    if draft is None:
        raise Refusal("custom_pair_ids")
    if is_gguf(target) or is_gguf(draft):
        from .gguf_pair import load_named
        budget = float("inf") if o.budget_gb is None else o.budget_gb * 1e9
        return load_named(target, draft, dev, dt, progress, o.cache_dir, exact=quant == "blocks",
                          lazy=(quant == "int8" and dev.type == "cpu", cheap_draft and dev.type == "cpu"),
                          budget_bytes=budget)
    return load_hub_pair(target, draft, dev, dt, progress), {}


def quantise_draft(draft: torch.nn.Module, saved, source: str) -> dict:
    """The draft quantised in place (quant.draft_to_int4), its weights kept in `saved` where there is one; returns
    what the pair's info says of it."""
    from .quant import Int4Linear, draft_to_int4, quant_label

    draft_to_int4(draft, saved=saved, source=source)
    own = int4_vnni.library()[1]  # the build of ours
    int4 = {own if m.tiles is not None else "torch" for m in draft.modules() if isinstance(m, Int4Linear)}
    return {"draft_quant": quant_label(draft), **({"draft_int4": "/".join(sorted(int4))} if int4 else {})}


def pack_and_release(pair: Pair, pack: bool) -> dict:
    """pack: every remaining bfloat16 Linear weight prepacked for oneDNN (the same numbers, faster); then each model's
    parameters in memory of its own, and the heap that loading freed given back. Returns what the pair's info says
    of it."""
    from .quant import can_pack, pack_linears

    said = {}
    for role in ("target", "draft") if pack else ():
        model = getattr(pair, role)
        if model is not None and can_pack(model):
            pack_linears(model)
            said.update(packed="oneDNN prepacked weights", **({"target_prepacked": True} if role == "target" else {}))
    for model in (pair.target, pair.draft):
        if model is not None:
            own_memory(model)
    release_freed_memory()
    return said


def auto_target_quant(target: str, device: torch.device) -> str:
    """How a target computes by default: on CPUs exact, on GGUF blocks (a GGUF target's own; a Hub checkpoint's
    values made Q8_0 ones) where their AVX-512 VNNI or AVX2 product runs (the portable build, one lane at a time, would
    be far slower than int8's products), else int8; the tiny test pair and GPUs as loaded."""
    if device.type != "cpu" or target == "tiny":
        return "off"
    return "blocks" if kquant_library()[1] in ("avx512-vnni", "avx2") else "int8"


def on_blocks(model: torch.nn.Module) -> bool:
    """Whether the model computes on GGUF blocks already (a GGUF target read so)."""
    from .kernels.kquant import KQuantLinear

    return any(isinstance(m, KQuantLinear) for m in model.modules())


def own_memory(model: torch.nn.Module) -> None:
    """Copy the parameters still read from their file into memory of the model's own. A tensor loaded
    from safetensors maps the whole file, and every page of it that was read stays resident while any
    tensor of the file is alive: after packing and quantising, the few left (embeddings, norms, biases)
    would keep the whole file's pages (GBs) counted against the process. (Buffers are computed or made
    by the quantised layers, never mapped.)"""
    with torch.no_grad():
        for param in {id(p): p for p in model.parameters()}.values():
            param.data = param.data.clone()


def release_freed_memory() -> None:
    """Give the heap that loading freed (quantising passes through float32 copies) back to the system;
    glibc keeps it otherwise, and it would count as the app's memory for as long as it runs."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def enable_graphs(pair: Pair, backend: str, max_len: int, progress: Progress | None = None,
                  one_shape: bool = True) -> Pair:
    """Compile both models' decoding steps now, for the sizes a default round uses, so that the
    first run does not stop to compile (on a 7B-shaped target on an H200: minutes), with transformers' SDPA
    attention (docs/benchmarks.md: the compiled H200 runs). one_shape: the target's at one size (LoadOptions).
    Returns the pair that runs them (its context capped to fit the static caches)."""
    progress = progress or (lambda f, m: None)
    if pair.target.config._attn_implementation == ROWS:
        raise Refusal("graphs_rows")

    # a default round scores up to SpecConfig().k + 1 tokens (padded to 32); a draft step feeds one or two tokens
    # and up to MAX_GUESS guesses behind them
    draft_sizes = [s for s in PADDED_SIZES if s <= padded_size(2 + MAX_GUESS)]
    width = PADDED_SIZES[-1] if one_shape else None
    target_sizes = [width] if width else PADDED_SIZES
    for role, model, sizes in (("target", pair.target, target_sizes), ("draft", pair.draft, draft_sizes)):
        if model is None:
            continue
        model.set_attn_implementation("sdpa")
        pair.compiled[role] = CompiledForward(model, max_len, backend, width if role == "target" else None)
        lm = pair.cached(role)
        lm.prefill([0] * 8)
        for n in sizes:
            progress(0.95, Note("load_compiling", backend=backend, n=n))
            lm.forward(torch.zeros(n, dtype=torch.long, device=lm.device), keep=1)
            lm.crop(8)
    graphs = f"compiled steps ({backend}), static caches of {max_len} positions" + (
        f", the target's at one shape ({width} rows)" if width else "")
    return replace(pair, context_length=min(pair.context_length, max_len - PADDED_SIZES[-1]),
                   info=replace(pair.info, graphs=graphs))


def load_hub_pair(target_id: str, draft_id: str, device: torch.device, dtype: torch.dtype,
                  progress: Progress) -> Pair:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(model_id, placement):
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, device_map=placement,
                                                    use_safetensors=True, trust_remote_code=False)

    progress(0.05, Note("load_tokenizers", target=target_id, draft=draft_id))
    tok = AutoTokenizer.from_pretrained(target_id, trust_remote_code=False)
    draft_tok = AutoTokenizer.from_pretrained(draft_id, trust_remote_code=False)
    check_tokenizers(tok, draft_tok, target_id, draft_id)  # fail before loading gigabytes of weights
    progress(0.1, Note("load_target", model=target_id))
    # accelerate spreads a target too large for one GPU over all of them; the draft follows its first device
    target = load(target_id, "auto" if device.type == "cuda" else str(device))
    first = target.get_input_embeddings().weight.device
    progress(0.7, Note("load_draft", model=draft_id))
    draft = load(draft_id, str(first))
    return make_pair(f"{target_id} <- {draft_id}", target, draft, tok, first, dtype,
                     PairInfo(target_id, draft_id))
