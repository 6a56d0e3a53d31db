"""specdec_core: lossless speculative decoding for Hugging Face causal LMs."""
from .config import SpecConfig
from .drafters import make_drafter
from .engine import autoregressive_generate, generate, speculative_generate
from .events import Result, RoundEvent, Stats, summarize
from .models import Pair, load_pair

__all__ = ["SpecConfig", "Pair", "Result", "RoundEvent", "Stats", "load_pair", "generate", "speculative_generate",
           "autoregressive_generate", "make_drafter", "summarize"]
