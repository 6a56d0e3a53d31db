"""A tiny random model pair built from configs in code: no download, runs in milliseconds.

The tokenizer is byte-level (256 bytes + a few control tokens), so any text round-trips.
The draft is a perturbed copy of the target, so rounds see full, partial and zero acceptance.
Tests that need EOS put it where they want it (Pair.eos_ids).

Its two models are of one size, so a draft forward costs about what a target step does and timed costs would have the
policy draft almost never, as it should for such a pair, and each race would turn on the machine's load of the moment.
The pair carries NOMINAL_COSTS instead (a free draft, a pass of any size a step): every round drafts as far as asked,
and a race of it shows drafts, verdicts and trees the same on any machine.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..theory import PassCosts

NOMINAL_COSTS = PassCosts({1: 1.0, 65: 1.0}, draft=0.0)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab: int, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       tie_word_embeddings=False, initializer_range=0.2, eos_token_id=vocab - 1)


def tiny_models(seed: int = 0, noise: float = 0.03, layers: int = 2):
    """(target, draft): the draft has the target's weights plus relative Gaussian noise `noise`."""
    tok = tiny_tokenizer()
    cfg = tiny_config(len(tok), layers)
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # EOS never wins greedily, so greedy runs last until max_new_tokens
        target.lm_head.weight[tok.eos_token_id].zero_()
    draft = Qwen2ForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn(w.shape, generator=g) * noise * w.std().nan_to_num(0.0))
    return target, draft, tok
