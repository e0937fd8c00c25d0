"""`convit-scale prep` (convit_scale/cli/prep.py): one sub-command per kind with its own options, another kind's
option refused naming its kind, and `prep verify OUT --src SRC` verifying OUT (and OUT's manifest against SRC)."""

from __future__ import annotations

import shutil

import pytest

from convit_scale.cli import build_parser, main

FFCV_ONLY = ["--max-resolution", "--jpeg-quality", "--write-mode"]
WDS_ONLY = ["--shard-size", "--seed"]


def _help(*argv: str) -> str:
    sub = build_parser()
    for name in argv:
        sub = next(a for a in sub._actions if a.dest in ("command", "kind")).choices[name]
    return sub.format_help()


def test_each_kind_shows_only_its_own_options():
    ffcv, wds = _help("prep", "ffcv"), _help("prep", "wds")
    assert all(f in ffcv for f in FFCV_ONLY) and not any(f in ffcv for f in WDS_ONLY)
    assert all(f in wds for f in WDS_ONLY) and not any(f in wds for f in FFCV_ONLY)
    assert "--src" in ffcv and "--subset-fraction" in wds
    verify = _help("prep", "verify")
    assert "DIR" in verify and not any(f in verify for f in FFCV_ONLY + WDS_ONLY + ["--subset-fraction"])


@pytest.mark.parametrize("argv,owner", [
    (["ffcv", "--shard-size", "500"], "prep wds"),
    (["ffcv", "--seed=3"], "prep wds"),
    (["wds", "--jpeg-quality", "95"], "prep ffcv"),
    (["wds", "--write-mode", "raw"], "prep ffcv"),
    (["verify", "OUT", "--shard-size", "5"], "prep wds"),
    (["verify", "OUT", "--out", "X"], "prep ffcv / wds / index / fashion-mnist"),
])
def test_an_option_of_another_kind_is_refused_naming_its_kind(argv, owner, tmp_path, capsys):
    kind, flag = argv[0], next(a for a in argv if a.startswith("--")).split("=")[0]
    paths = ["--src", str(tmp_path / "src"), "--out", str(tmp_path / "out")] if kind != "verify" else []
    argv = [str(tmp_path / a) if a == "OUT" else a for a in argv]
    assert main(["prep", *argv, *paths]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: convit-scale prep {kind}: argument {flag}")
    assert f"is an option of `{owner}`, not of `prep {kind}`" in lines[0], lines[0]
    assert not out and not list(tmp_path.iterdir())


def test_verify_with_src_verifies_the_output_and_its_source(fm_tree, fm_wds, tmp_path, capsys):
    """Before the fix `prep verify OUT --src SRC` verified SRC (no manifest there: a failure)."""
    assert main(["prep", "verify", str(fm_wds), "--src", str(fm_tree)]) == 0
    out = capsys.readouterr().out
    assert f"verified {fm_wds}: every file matches the manifest, and the manifest matches {fm_tree}" in out

    src = tmp_path / "src"  # a source with one image more than the output accounts for
    shutil.copytree(fm_tree, src)
    first = sorted(p for p in (src / "train").iterdir() if p.is_dir())[0]
    image = sorted(first.iterdir())[0]
    shutil.copy(image, first / ("extra" + image.suffix))
    assert main(["prep", "verify", str(fm_wds), "--src", str(src)]) == 1
    out, err = capsys.readouterr()
    assert f"{src / 'train'}: 1001 images (subset fraction 1) and 0 unlabelled file(s), but the manifest accounts " \
           f"for 1000 (1000 written, 0 skipped)" in err
    assert f"{fm_wds}: 1 problem(s)" in out

    (src / "train" / "n_new_class").mkdir()  # another class list
    (src / "train" / "n_new_class" / image.name).write_bytes(image.read_bytes())
    assert main(["prep", "verify", str(fm_wds), "--src", str(src)]) == 1
    assert "11 class folders in train/, the manifest has 10 classes" in capsys.readouterr().err


def test_verify_names_the_output_it_checked(fm_wds, tmp_path, capsys):
    out = tmp_path / "w"
    shutil.copytree(fm_wds, out)
    shard = sorted(out.glob("train-*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    assert main(["prep", "verify", str(out), "--src", str(fm_wds)]) == 1  # --src is no prepared folder's source
    err = capsys.readouterr().err
    assert shard.name in err and "checksum differs" in err
    assert f"--src {fm_wds}: no train folder" in err


def test_verify_of_a_missing_folder_is_bad_input(tmp_path, capsys):
    assert main(["prep", "verify", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere: no such folder" in err


def test_a_bare_prep_lists_its_kinds_and_a_misspelt_option_gets_a_suggestion(capsys):
    assert main(["prep"]) == 2
    assert "allowed: ffcv, wds, index, verify, fashion-mnist" in capsys.readouterr().err
    assert main(["prep", "ffcv", "--src", "a", "--out", "b", "--max-resolutoin", "3"]) == 2
    assert "did you mean --max-resolution?" in capsys.readouterr().err
