"""`find_inputs`, what `ocrq run` and `ocrq submit` make of their path arguments: the files in
sorted order, what the folders held that is no image (counted, not kept), and the roots a run
may read (the folders named, not one per subfolder: each root is checked for every image)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ocrq.worker.embedded import find_inputs


def test_folders_are_searched_beneath_and_their_roots_are_the_folders_named(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "tree"
    for rel in ("b/2.png", "a/deep/1.JPG", "a/notes.txt", "c.pdf", ".hidden/x.png", "a/.y.png",
                "a/data.csv", "README"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(b"x")
    single = tmp_path / "elsewhere" / "one.txt"  # named on purpose: kept, whatever it is
    single.parent.mkdir()
    single.write_bytes(b"x")

    found = find_inputs([tree, single])

    assert found.files == [tree / "a/deep/1.JPG", tree / "b/2.png", tree / "c.pdf", single]
    assert found.skipped == Counter({".txt": 1, ".csv": 1, "(none)": 1})
    assert found.unreadable == 0
    assert found.roots == sorted([tree.resolve(), single.parent.resolve()])
