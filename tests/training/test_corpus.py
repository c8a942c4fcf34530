"""The stdlib corpus: which files count, and a split that is by file and fixed by the seed."""

from specsplit.training.corpus import list_source_files, split_files, stdlib_root


def write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))


def test_source_files_skip_third_party_generated_and_non_utf8(tmp_path):
    write(tmp_path / "a.py", "x = 1\n")
    write(tmp_path / "pkg" / "b.py", "y = 2\n")
    write(tmp_path / "site-packages" / "c.py", "z = 3\n")
    write(tmp_path / "encodings" / "cp0.py", '""" Python Character Mapping Codec generated from X.TXT """\n')
    write(tmp_path / "latin.py", "# -*- coding: latin-1 -*-\ns = '\xe9'\n", encoding="latin-1")
    write(tmp_path / "notes.txt", "not python\n")
    assert list_source_files(tmp_path) == ["a.py", "pkg/b.py"]


def test_split_is_by_file_and_fixed_by_the_seed():
    files = [f"mod{i:03d}.py" for i in range(200)]
    split = split_files(stdlib_root(), files, seed=0)
    parts = [split.train, split.valid, split.heldout]
    assert sorted(f for part in parts for f in part) == files  # every file in exactly one split
    assert (len(split.heldout), len(split.valid)) == (10, 4)
    assert all(part == sorted(part) for part in parts)
    assert split_files(stdlib_root(), list(reversed(files)), seed=0) == split  # input order is irrelevant
    assert split_files(stdlib_root(), files, seed=1).heldout != split.heldout


def test_the_real_stdlib_has_enough_files():
    files = list_source_files(stdlib_root())
    assert len(files) > 500
    assert "os.py" in files and not any("site-packages" in f for f in files)
