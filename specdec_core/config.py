"""Generation settings: one dataclass, validated in one place."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .messages import Refusal

# Caps shared by the engine, the app and the API. They bound the work one request can ask for.
MAX_K = 16
MAX_TREE_NODES = 64
MAX_GUESS = 3  # a draft step's guesses: as many as the 2- or 3-token n-gram they follow is long
MAX_NEW_TOKENS = 1024
MAX_TEMPERATURE = 2.0
MAX_PROMPT_CHARS = 20_000
TARGET_QUANTS = ("auto", "off", "int8", "blocks")  # how the target may compute (models.LoadOptions)
GREEDY_BELOW = 1e-4  # temperatures below this are treated as 0 (greedy): softmax(l / 1e-9) is one-hot anyway


def setting(default, help: str):
    """A field's default and what it means, said once: the app's controls, its API and the bench's flags read both."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SpecConfig:
    """SpecConfig() is what the app starts with and the bench measures (docs/benchmarks.md has the measurements)."""
    k: int = setting(MAX_K, f"the most draft tokens a round (1..{MAX_K})")
    temperature: float = setting(0.0, "0 = greedy; applied identically to draft and target")
    top_k: int = setting(0, "keep only the k most likely tokens; 0 = off")
    top_p: float = setting(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    max_new_tokens: int = setting(128, f"hard cap on generated tokens (1..{MAX_NEW_TOKENS})")
    seed: int = setting(0, "seeds the explicit torch.Generator: same seed, same plain output; speculative output is the "
                           "same where the drafts are, and how far they go follows timed costs (a draw of the same "
                           "distribution)")
    chat: bool = setting(True, "wrap the prompt in the tokenizer's chat template when it has one")
    adaptive: bool = setting(False, "grow K after a fully accepted round, shrink it after a rejection")
    min_confidence: float = setting(0.0, "also stop a draft once the product of its top probabilities falls below this; "
                                         "0 = off: how far each round drafts is the measured costs' call (policy.py)")
    record_top: int = setting(0, "top-n probabilities kept per position in events (the app's inspector asks for 5); 0 = none")
    tree_nodes: int = setting(0, "draft a token tree of up to this many nodes (depth up to k) instead of a chain; 0 = a "
                                 "chain. How many are kept follows pass costs timed once per pair")
    guess: int = setting(MAX_GUESS, "a chain's draft step also checks up to this many tokens that followed its last 2-3 "
                                    f"tokens earlier in the text (0..{MAX_GUESS}, 0 = off); a guess the draft then draws "
                                    "needs no step of its own")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "bool"):
                if isinstance(v, float) and v.is_integer():
                    object.__setattr__(self, f.name, int(v))
                elif not isinstance(v, int):
                    raise Refusal("not_integer", name=f.name, value=repr(v))
            elif f.type == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise Refusal("not_number", name=f.name, value=repr(v))
                object.__setattr__(self, f.name, float(v))
        if not 1 <= self.k <= MAX_K:
            raise Refusal("k_range", limit=MAX_K, value=self.k)
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise Refusal("max_new_tokens_range", limit=MAX_NEW_TOKENS, value=self.max_new_tokens)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise Refusal("temperature_range", limit=MAX_TEMPERATURE, value=self.temperature)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise Refusal("top_p_range", value=self.top_p)
        if self.top_k < 0:
            raise Refusal("top_k_range", value=self.top_k)
        if not 0 <= self.seed < 2**63:
            raise Refusal("seed_range", value=self.seed)
        if not 0.0 <= self.min_confidence < 1.0:
            raise Refusal("min_confidence_range", value=self.min_confidence)
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise Refusal("tree_nodes_range", limit=MAX_TREE_NODES, value=self.tree_nodes)
        if not 0 <= self.guess <= MAX_GUESS:
            raise Refusal("guess_range", limit=MAX_GUESS, value=self.guess)
        if self.record_top < 0:
            raise Refusal("record_top_range", value=self.record_top)

    @classmethod
    def options(cls, skip=()) -> list[tuple[str, type, object, str]]:
        """(name, type, default, help) of every field but those in `skip`, in the order declared: what the API and
        the CLIs expose, so that a new setting reaches them from here."""
        kinds = {"int": int, "float": float, "bool": bool}
        return [(f.name, kinds[f.type], f.default, f.metadata["help"]) for f in fields(cls) if f.name not in skip]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
