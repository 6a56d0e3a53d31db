"""Prompt encoding and incremental detokenisation."""
from __future__ import annotations

from .messages import Refusal

_SLOT = "\ue000specdec-prompt\ue000"  # private-use characters: never in a chat template


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """User text -> token ids, inside the chat template when the tokenizer has one.

    The user's text is always tokenised literally: typing "<|im_end|>" yields the characters,
    not the control token, so a prompt cannot forge the conversation's structure.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise Refusal("prompt_empty")
    literal = tokenizer(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if chat and getattr(tokenizer, "chat_template", None):
        before, after = _template(tokenizer)
        return before + literal + after
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None else []
    return bos + literal


def template_head(tokenizer) -> list[int]:
    """The ids every chat prompt starts with (the template's system block and the user's turn
    marker); [] without a chat template."""
    return _template(tokenizer)[0] if getattr(tokenizer, "chat_template", None) else []


def _template(tokenizer) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(_SLOT)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
    return enc(before), enc(after)


class Detokenizer:
    """Turns a growing list of ids into per-token text pieces whose concatenation is the decoded text.

    A character split across tokens (multi-byte UTF-8, emoji) is held back and attributed to the
    token that completes it, so streaming never shows a broken character.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd"):  # incomplete character: wait for the next token
            return ""
        piece = text[len(self.text):]  # byte-level BPE decodes prefixes to prefixes
        self.text = text
        return piece

    def flush(self) -> str:
        """Whatever is still held back once generation ends (a trailing incomplete character)."""
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)
        piece, self.text = text[len(self.text):], text
        return piece


def token_text(tokenizer, token: int) -> str:
    """A single token's text on its own (for rejected draft tokens, which never join the output)."""
    return tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
