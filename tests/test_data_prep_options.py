"""A conversion's options (data_prep/options.py): each out of its range refused in one line that names it, its value
and what is allowed, by the library as by the command, before anything is read or written."""

from __future__ import annotations

import pytest

from convit_scale.imagetree import PrepError
from data_prep import PrepOptions, prepare
from data_prep.options import check_options


@pytest.mark.parametrize("field,value,name,allowed", [
    ("fmt", "tar", "format", "wds or ffcv"),
    ("subset_fraction", 0.0, "--subset-fraction", "in (0, 1]"),
    ("subset_fraction", 1.5, "--subset-fraction", "in (0, 1]"),
    ("jpeg_quality", 101, "--jpeg-quality", "in 1..100"),
    ("shard_size", 0, "--shard-size", ">= 1"),
    ("max_resolution", 0, "--max-resolution", ">= 1"),
    ("num_classes", 0, "--num-classes", ">= 1"),
    ("workers", 0, "--workers", ">= 1"),
    ("write_mode", "png", "--write-mode", "one of keep, jpg, raw, proportion, smart"),
])
def test_an_option_out_of_range_is_refused_naming_it(field, value, name, allowed, fm_tree, tmp_path):
    opts = PrepOptions(**{field: value})
    with pytest.raises(PrepError) as e:
        check_options(opts)
    assert str(e.value) == f"prep {name} {value!r} is not allowed: must be {allowed}"
    with pytest.raises(PrepError, match="is not allowed"):  # the library's entry checks them before reading
        prepare(fm_tree, tmp_path / "out", opts)
    assert not (tmp_path / "out").exists()


def test_the_defaults_and_the_range_ends_are_allowed():
    check_options(PrepOptions())
    check_options(PrepOptions(fmt="ffcv", subset_fraction=1.0, jpeg_quality=1, shard_size=1, max_resolution=1,
                              num_classes=1, workers=1, write_mode="smart"))
    check_options(PrepOptions(jpeg_quality=100, subset_fraction=0.01))
