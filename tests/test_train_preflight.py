"""The checks before any process starts (convit_scale/train/preflight.py), called as the launcher calls them: a
recipe whose data and output folder are in order passes without writing anything, and each refusal is one line
naming the key. The command's refusals, case by case, are in test_bad_input.py."""

from __future__ import annotations

import shutil

import pytest
from support import tiny_recipe

from convit_scale.config import load_config
from convit_scale.data import DataError
from convit_scale.errors import BadInput
from convit_scale.train.preflight import preflight


def _cfg(tmp_path, data, *overrides):
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", data, tmp_path / "run" / "out", parallel={"strategy": "none"})
    return load_config(recipe, list(overrides))


def test_a_recipe_in_order_passes_and_nothing_is_written(fm_wds, tmp_path):
    preflight(_cfg(tmp_path, fm_wds))
    assert not (tmp_path / "run").exists()


def test_without_the_crop_decoder_a_run_refuses_to_start_unless_asked(fm_wds, tmp_path, monkeypatch):
    """Where convit_scale/_jpeg_roi.c's library is found nowhere (tests/test_packaging.py: not beside the module, nor
    in an installed copy), every rank would decode whole JPEGs: the run refuses, unless data.whole_jpeg_decode."""
    from convit_scale import jpeg_roi

    monkeypatch.setattr(jpeg_roi, "AVAILABLE", False)
    with pytest.raises(BadInput, match=r"^data.whole_jpeg_decode = false: the crop-region JPEG decoder is missing"):
        preflight(_cfg(tmp_path, fm_wds))
    preflight(_cfg(tmp_path, fm_wds, "data.whole_jpeg_decode=true"))


def test_the_output_folder_and_the_datas_files_are_checked(fm_wds, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(BadInput, match=r"^run.output_dir = .*a_file/out: .*a_file is a file, not a folder"):
        preflight(_cfg(tmp_path, fm_wds, f"run.output_dir={tmp_path / 'a_file' / 'out'}"))
    with pytest.raises(DataError, match=r"^data.val_path: .*nowhere does not exist$"):
        preflight(_cfg(tmp_path, fm_wds, f"data.val_path={tmp_path / 'nowhere'}"))
    copy = tmp_path / "wds"
    shutil.copytree(fm_wds, copy)
    shard = sorted(copy.glob("val-*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[:512])
    with pytest.raises(DataError) as e:
        preflight(_cfg(tmp_path, copy))
    assert str(e.value).startswith(f"data.val_path: {shard} has 512 bytes, manifest.json records ")
    assert "\n" not in str(e.value)
