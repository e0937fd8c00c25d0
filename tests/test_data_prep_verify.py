"""`prep verify` (data_prep/verify.py): a file that no longer matches the manifest's checksum is named; the loader
refuses the same truncated shard while training."""

import pytest
from support import run_cli

from convit_scale.config import DataConfig
from convit_scale.data import DataError, LoaderSpec, build_loader
from data_prep import PrepOptions, prepare, verify


def test_verify_catches_a_corrupted_shard_and_loader_refuses_a_truncated_one(fm_tree, tmp_path):
    out = tmp_path / "w"
    prepare(fm_tree, out, PrepOptions(fmt="wds", shard_size=250, workers=2))
    shard = sorted(out.glob("train-*.tar"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    problems = verify(out)
    assert any(shard.name in p and "checksum" in p for p in problems)
    res = run_cli("prep", "verify", str(out))
    assert res.returncode == 1 and shard.name in res.stderr
    d = DataConfig(format="wds", train_path=str(out), val_path=str(out), num_workers=0, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", 32, 50))
    with pytest.raises(DataError, match="truncated or corrupt shard"):
        for _ in loader.epoch(0):
            pass
