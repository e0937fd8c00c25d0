"""Atomic publication (convit_scale/files.py): a reader sees the old content or the new, never a part."""

from __future__ import annotations

import pytest

from convit_scale.files import atomic_path, publish_dir, recover_swap, write_atomic, write_json_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    write_atomic(path, "step_1\n")
    write_atomic(path, b"step_2\n")
    write_json_atomic(tmp_path / "m.json", {"a": 1})
    assert path.read_text() == "step_2\n" and (tmp_path / "m.json").read_text() == '{\n "a": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "m.json"]


def test_a_failed_writer_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer died")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_publish_dir_swaps_and_recover_puts_back_what_a_crash_left(tmp_path):
    final, tmp = tmp_path / "step_4", tmp_path / "step_4.tmp"
    for folder, text in ((final, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "meta.json").write_text(text)
    publish_dir(tmp, final)
    assert (final / "meta.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]
    # a crash between the two renames: step_4 moved to .old, the new one not yet renamed
    final.rename(tmp_path / "step_4.old")
    (tmp_path / "step_4.tmp").mkdir()  # incomplete: no meta.json
    recover_swap(final, "meta.json")
    assert (final / "meta.json").read_text() == "new"  # the complete old one is back
    (final / "meta.json").unlink()
    recover_swap(final, "meta.json")  # final exists: left alone
    assert final.is_dir()


def test_safetensors_published_through_atomic_path_and_best_are_readable_by_others(tmp_path):
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from convit_scale.train.checkpoint import save_best

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "export.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))  # safetensors creates its file 0600
        best = save_best(tmp_path, {"w": torch.zeros(2)}, {"step": 1, "config": {"model": {}}})
    finally:
        os.umask(old)
    for path in (tmp_path / "export.safetensors", best / "model.safetensors", best / "meta.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
