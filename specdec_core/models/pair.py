"""A model pair: a target, a draft sharing its tokenizer, and what belongs to the two models. A Pair is built once,
by load_pair, and never changed after (frozen: dataclasses.replace makes another)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cache import CachedModel, CompiledForward, SharedHead
from ..messages import Refusal
from ..text import template_head
from ..theory import PassCosts
from ..timing import tree_costs

Progress = Callable[[float, str], None]  # (fraction done, message)


@dataclass(frozen=True)
class PairInfo:
    """What people are shown of a pair: its models and how each computes."""
    target: str = ""  # the models' names
    draft: str = ""
    target_quant: str = ""  # how the target computes, resolved (load.LoadOptions.target_quant)
    # said in the status: a dtype, "int8", "blocks:<build>" (its GGUF file's) or "q8_0:<build>" (made from its values)
    target_weights: str = ""
    target_int8: str = ""  # the int8 target's product(s)
    target_prepacked: bool = False
    draft_quant: str = ""  # "int4", or "int8" where int4 fits no layer; "" as loaded
    draft_int4: str = ""  # the int4 draft's product(s)
    packed: str = ""
    graphs: str = ""  # compiled steps, on a GPU


@dataclass(frozen=True)
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
    info: PairInfo = field(default_factory=PairInfo)
    compiled: dict[str, CompiledForward] = field(default_factory=dict)  # "target" / "draft" -> its compiled forward
    heads: dict[str, SharedHead] = field(default_factory=dict)  # "target" / "draft" -> the chat head's keys and values
    written: dict[str, Callable] = field(default_factory=dict)  # "target" / "draft" -> its forwards written out (step.py)
    pass_costs: PassCosts | None = None  # what sizes drafts here; None: timed on first use (costs())
    timed: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # what costs() timed

    def costs(self) -> PassCosts:
        """The target's passes and the draft's forward relative to a target step: `pass_costs`, or timed on this
        device on first use (timing.tree_costs) and kept with the pair."""
        if not self.costs_known:
            self.timed["passes"] = tree_costs(self)
        return self.pass_costs if self.pass_costs is not None else self.timed["passes"]

    def read_heads(self) -> None:
        """Each model's chat head (cache.SharedHead) read now where it was not yet: after this, an answer's prompt
        time is its own tokens' (a static cache has no head to read)."""
        for role in self.heads:
            lm = self.cached(role)
            if lm.head is not None and lm.head.cache is None:
                lm.prefill(lm.head.ids)

    @property
    def costs_known(self) -> bool:
        """Whether costs() answers without timing anything (a first race's wait: the app says so first)."""
        return self.pass_costs is not None or "passes" in self.timed

    def cached(self, role: str) -> CachedModel:
        """A fresh cache over the target or the draft, with that model's compiled or written-out forwards and shared
        head (not another model's: dataclasses.replace may have swapped the model and kept the dicts)."""
        model = getattr(self, role)

        def own(kind: str):
            found = getattr(self, kind).get(role)
            return found if found is not None and found.model is model else None
        return CachedModel(model, self.vocab, own("compiled"), own("heads"), own("written"))


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: as DTYPES names it, in reports and the cache's file names."""
    return str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}") from None


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware runs it natively (CUDA, CPUs with AVX512-BF16/AMX), else
    float16 on MPS, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return dtype_named(dtype)
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
        raise Refusal("tokenizers_differ", draft=repr(draft_name), target=repr(target_name))


def make_pair(name, target, draft, tokenizer, device, dtype, info: PairInfo | None = None) -> Pair:
    rows = [target.get_output_embeddings().weight.shape[0]]
    if draft is not None:
        rows.append(draft.get_output_embeddings().weight.shape[0])
    vocab = min(len(tokenizer), *rows)
    ctx = getattr(target.config, "max_position_embeddings", None) or 4096
    head = template_head(tokenizer)  # every prompt's chat-template head is computed once per model
    heads = {role: SharedHead(head, model) for role, model in (("target", target), ("draft", draft))
             if model is not None and head}
    return Pair(name, target.eval(), draft.eval() if draft is not None else None, tokenizer, vocab,
                eos_ids_of(target, tokenizer), int(ctx), device, dtype, info or PairInfo(), heads=heads)


def first_divergence(pair: Pair, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs of the same prompt part, and the target's logits of the two tokens there, from
    one pass over the prompt and the common prefix (None: they do not part). On a target whose logits depend on
    the shape of the pass (bfloat16 on CPUs or GPUs), a near-tie can be won by one token in a one-token step and
    by the other in a verification pass."""
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None:
        return None
    with torch.inference_mode():
        logits = pair.target(torch.tensor([prompt_ids + a[:pos]], device=pair.device), logits_to_keep=1).logits[0, -1]
    logits = logits.float()[: pair.vocab]
    logp = torch.log_softmax(logits, -1)
    return {"position": pos, "ar_token": a[pos], "spec_token": b[pos], "ar_logit": float(logits[a[pos]]),
            "spec_logit": float(logits[b[pos]]), "logprob_gap": float(logp[a[pos]] - logp[b[pos]])}
