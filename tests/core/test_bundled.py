"""The bundled pair: its files and cache, on stand-ins (fast), and the real pair, its target exact on its GGUF's blocks (slow)."""
import copy
import dataclasses

import pytest
import torch

from specdec_core import SpecConfig, generate, load_pair
from specdec_core.messages import Refusal
from specdec_core.models import bundled, gguf_pair
from specdec_core.models.tiny import NOMINAL_COSTS, tiny_models

from ..conftest import with_eos


@pytest.fixture(scope="module")
def bundled_pair():
    return load_pair("bundled", device="cpu", dtype="float32")


@pytest.mark.slow
@pytest.mark.bundled
def test_the_progress_says_ready_once_the_pair_is_ready(monkeypatch):
    """A first start quantises the draft for seconds after its files are read: the progress names that phase, and
    says "ready" once, last, after it."""
    from specdec_core.models import quant

    seen = []
    quantise = quant.draft_to_int4
    monkeypatch.setattr(quant, "draft_to_int4", lambda *a, **kw: (seen.append("quantising"), quantise(*a, **kw))[1])
    load_pair("bundled", device="cpu", progress=lambda fraction, note: seen.append((fraction, note.key)))
    keys = [x if isinstance(x, str) else x[1] for x in seen]
    assert keys[-3:] == ["load_draft_int4", "quantising", "load_ready"] and keys.count("load_ready") == 1
    fractions = [x[0] for x in seen if not isinstance(x, str)]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


@pytest.mark.slow
@pytest.mark.bundled
@pytest.mark.parametrize("prompt", ["Write a Python function that checks whether a number is prime.",
                                    "Explain what a hash map is in two sentences."])
def test_greedy_speculative_equals_the_targets_own_greedy_output(bundled_pair, prompt):
    """32 tokens, wherever the answer ends, every round drafting 4: this machine's timed costs would have the policy
    take plain steps where drafting does not pay (this fixture's draft is int8), and leave the drafts unchecked."""
    cfg, pair = SpecConfig(k=4, max_new_tokens=32), with_eos(bundled_pair, [])
    ar = generate(pair, prompt, cfg, "autoregressive")
    spec = generate(dataclasses.replace(pair, pass_costs=NOMINAL_COSTS), prompt, cfg)
    assert len(ar.token_ids) == 32
    assert spec.token_ids == ar.token_ids
    assert spec.stats.plain_steps == 0 and spec.stats.rounds < 32
    assert spec.stats.acceptance_rate > 0.3  # a real draft of the same family agrees most of the time


@pytest.mark.slow
@pytest.mark.bundled
@pytest.mark.parametrize("context", [128, 1030])
def test_the_default_target_gives_a_position_the_same_logits_in_a_step_and_in_any_pass(bundled_pair, context):
    """The CPU default (the target on its file's Q4_K/Q6_K blocks): 17 positions fed one at a time, as plain decoding does, against the
    same positions in one chain pass, and a tree's branch against its tokens fed alone: equal bit for bit, through the
    forward the pair runs."""
    from specdec_core.models.kernels import kquant

    from .models.test_int8 import logits_alone_and_in_a_pass

    assert bundled_pair.info.target_quant == ("blocks" if kquant.library()[1] == "avx512-vnni" else "int8")
    assert bundled_pair.target.config._attn_implementation == "specdec_rows"
    written = bundled_pair.written.get("target")  # on the blocks, every forward written out (step.py)
    assert (written is not None) == (bundled_pair.info.target_quant == "blocks")
    alone, chain, branch, branch_alone = logits_alone_and_in_a_pass(bundled_pair.target, bundled_pair.vocab, context,
                                                                    written)
    assert torch.equal(alone, chain) and torch.equal(branch, branch_alone)


def test_the_parts_are_checked_against_the_pinned_sha256_before_they_are_read(tmp_path, monkeypatch):
    import hashlib

    parts = [tmp_path / "p1", tmp_path / "p2"]
    parts[0].write_bytes(b"GGUF" + b"x" * 100)
    parts[1].write_bytes(b"y" * 50)
    good = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    monkeypatch.setattr(bundled, "part_paths", lambda m: parts)
    model = bundled.BundledModel("test", "test", "none", 2, good, 154)
    assert bundled.checked_parts(model) == parts
    parts[1].write_bytes(b"z" * 50)  # one byte of a part changed: same size
    with pytest.raises(Refusal, match="Checksum mismatch for test") as refused:
        bundled.checked_parts(model)
    assert refused.value.key == "bundled_damaged"  # said in the visitor's language by the app
    parts[1].write_bytes(b"")  # emptied (a map of it cannot be made): refused the same way
    with pytest.raises(Refusal, match="Checksum mismatch for test"):
        bundled.checked_parts(model)


def test_converted_copies_of_earlier_versions_are_removed_and_nothing_else(tmp_path):
    for name in (f"{bundled.TARGET.slug}-bfloat16", bundled.DRAFT.slug, f"{bundled.DRAFT.slug}-float32"):
        (tmp_path / name).mkdir()
        (tmp_path / name / gguf_pair.MANIFEST).write_text("{}")
    (tmp_path / f"{bundled.TARGET.slug}-mine").mkdir()  # not ours: no manifest
    (tmp_path / "kernels").mkdir()
    # quantised files named before each dtype had its own (a float32 load overwrote the default's), and today's
    kept = [f"{bundled.DRAFT.slug}-int4-bfloat16.safetensors", f"{bundled.DRAFT.slug}-int4-bfloat16.safetensors.sha256",
            f"{bundled.TARGET.slug}-int8-float32.safetensors"]
    for name in [f"{bundled.DRAFT.slug}-int4.safetensors", f"{bundled.DRAFT.slug}-int4.safetensors.sha256",
                 f"{bundled.DRAFT.slug}-int4.safetensors.lock", f"{bundled.TARGET.slug}-int8.safetensors", *kept]:
        (tmp_path / name).write_bytes(b"x")
    bundled.remove_old_layouts(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["kernels", f"{bundled.TARGET.slug}-mine", *kept])


@pytest.mark.parametrize("damage", ["a flipped byte", "truncated", "no digest"])
def test_a_damaged_quantised_draft_is_made_again_never_loaded(tmp_path, damage):
    """The draft's int4 weights are kept in the cache: one flipped byte in their data (the size and the metadata
    unchanged) is found by the digest written with them, and the file is made again from the model."""
    from specdec_core.models.quant import draft_to_int4

    _, draft, _ = tiny_models()
    path = tmp_path / "draft-int4.safetensors"
    x = torch.randn(3, 64)

    def made():
        model = draft_to_int4(copy.deepcopy(draft).to(torch.bfloat16), saved=path, source="tiny")
        with torch.inference_mode():
            return model.model.layers[0].mlp.up_proj(x.bfloat16())

    want = made()
    digest = path.with_name(path.name + ".sha256").read_text()
    data = bytearray(path.read_bytes())
    if damage == "a flipped byte":
        data[-100] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-100]))
    else:
        path.with_name(path.name + ".sha256").unlink()
    stamp = path.stat().st_mtime_ns
    assert torch.equal(made(), want)
    assert path.stat().st_mtime_ns != stamp and path.with_name(path.name + ".sha256").read_text() == digest


@pytest.mark.slow
@pytest.mark.bundled
def test_the_kept_tokenizer_is_read_only_while_its_files_match_their_digests(tmp_path):
    """A first start makes the tokenizer from the checked target file and keeps it; a warm start reads it, unless one
    byte of its files changed: then it is made again."""
    from specdec_core.models.gguf_model import GGUF

    target = GGUF(bundled.checked_parts(bundled.TARGET))
    made = gguf_pair.tokenizer_of(target, tmp_path, bundled.TARGET.sha256)
    vocabulary = next(tmp_path.glob("tokenizer-*")) / "tokenizer.json"
    whole, stamp = vocabulary.read_bytes(), vocabulary.stat().st_mtime_ns
    kept = gguf_pair.tokenizer_of(target, tmp_path, bundled.TARGET.sha256)
    text = "def prime(n):  # é, 中文 <|im_end|>"
    chat = [{"role": "user", "content": text}]
    assert kept.encode(text) == made.encode(text) and kept.decode(made.encode(text)) == text
    assert kept.apply_chat_template(chat, add_generation_prompt=True) == made.apply_chat_template(chat, add_generation_prompt=True)
    assert (kept.eos_token_id, kept.pad_token_id, len(kept)) == (made.eos_token_id, made.pad_token_id, len(made))
    assert vocabulary.stat().st_mtime_ns == stamp  # read, not made again
    vocabulary.write_bytes(whole.replace(b'"def"', b'"dfe"', 1))
    assert gguf_pair.tokenizer_of(target, tmp_path, bundled.TARGET.sha256).encode(text) == made.encode(text)
    assert vocabulary.read_bytes() == whole


@pytest.mark.slow
@pytest.mark.bundled
def test_a_first_start_killed_midway_leaves_no_process_behind(tmp_path):
    """The bundled models are read and converted on threads of the process itself: killing it mid-start leaves
    nothing running (an earlier version's conversion workers outlived it, blocked on a pipe, holding 3.4 GB)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def children(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                    found.append(int(entry))
            except OSError:
                pass
        return found

    env = dict(os.environ, SPECDEC_CACHE=str(tmp_path))  # an empty cache: a first start
    start = subprocess.Popen([sys.executable, "-c", "from specdec_core import load_pair; load_pair('bundled')"], env=env)
    seen = set()
    deadline = time.time() + 120
    # killed while the draft is being converted (its file locked for writing, seconds before it is saved); a fixed
    # delay is not midway, as a first start takes 15-35 s by machine
    converting = lambda: any(tmp_path.glob("*.safetensors.lock"))
    while time.time() < deadline and start.poll() is None and not converting():
        seen.update(children(start.pid))
        time.sleep(0.1)
    time.sleep(1.0)
    seen.update(children(start.pid))
    assert converting() and not any(tmp_path.glob("*-int4.safetensors")), "not killed while converting"
    assert start.poll() is None, "the start ended before it could be killed"
    os.kill(start.pid, signal.SIGKILL)
    start.wait()
    alive = lambda: [pid for pid in seen if os.path.exists(f"/proc/{pid}")]
    deadline = time.time() + 15  # a compiler building a kernel at that moment finishes its file and exits
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    assert alive() == [], f"processes left behind: {alive()}"
