"""specdec_core: lossless speculative decoding for Hugging Face causal LMs.

Its names are imported when first used, so that a light module (config, models.files) imports without PyTorch."""
import importlib

HOMES = {"SpecConfig": "config", "make_drafter": "drafters", "generate": "engine", "speculative_generate": "engine",
         "autoregressive_generate": "engine", "Result": "events", "RoundEvent": "events", "Stats": "events",
         "summarize": "events", "Pair": "models", "load_pair": "models"}
__all__ = list(HOMES)


def lazily(package: str, homes: dict):
    """A package's __getattr__: each name imported from its module (homes[name]) when first asked for."""
    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
    return __getattr__


__getattr__ = lazily(__name__, HOMES)
