"""files.py: digests begun early are taken only for files unchanged since, once; the module imports without PyTorch."""
import hashlib
import os
import subprocess
import sys

from specdec_core.models import files


def counted(monkeypatch) -> list:
    hashed = []
    real = files.sha256
    monkeypatch.setattr(files, "sha256", lambda paths: hashed.append(list(paths)) or real(paths))
    return hashed


def test_a_digest_begun_early_is_taken_once_for_files_unchanged_since(tmp_path, monkeypatch):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"first part " * 1000)
    b.write_bytes(b"second part " * 1000)
    want = hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()
    hashed = counted(monkeypatch)
    files.begin([a, b])
    assert files.file_digest(a, b) == want
    assert hashed == [[a, b]]  # hashed once, on the early thread
    assert files.file_digest(a, b) == want and len(hashed) == 2  # a later check hashes again


def test_a_file_changed_after_its_digest_was_begun_is_hashed_again(tmp_path, monkeypatch):
    part = tmp_path / "part.bin"
    part.write_bytes(b"\0" * 4096)
    hashed = counted(monkeypatch)
    files.begin([part])
    files._begun[files.identity([part])].result()  # the early digest is made, of the old bytes
    stat = part.stat()
    with open(part, "r+b") as f:  # the same size, its modification time put back: its change time still moves
        f.write(b"\1")
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files.file_digest(part) == hashlib.sha256(b"\1" + b"\0" * 4095).hexdigest()
    assert len(hashed) == 2


def test_begin_bundled_skips_what_is_missing_and_the_module_imports_without_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "part_paths", lambda m: [tmp_path / f"{m.slug}.gguf"])
    for m in (files.TARGET, files.DRAFT):
        (tmp_path / f"{m.slug}.gguf").write_bytes(m.slug.encode())
    hashed = counted(monkeypatch)
    files.begin_bundled("bfloat16", tmp_path)  # no int4 weights kept yet: the parts alone
    assert files.file_digest(tmp_path / f"{files.DRAFT.slug}.gguf") == hashlib.sha256(files.DRAFT.slug.encode()).hexdigest()
    assert [len(group) for group in hashed] == [1, 1]

    def not_installed(m):
        raise files.Refusal("bundled_missing", name=m.name, package=m.package)
    monkeypatch.setattr(files, "part_paths", not_installed)
    files.begin_bundled("bfloat16", tmp_path)  # parts not installed: nothing hashed, the load says so
    assert len(hashed) == 2
    code = "import sys, specdec_core.models.files, specdec_core.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
