"""Data faults at scale: shards that fail to open or to stream are reopened, samples that cannot be read or decoded
are replaced deterministically, listed and counted, and too many stop the run naming the shard or file."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from support import epoch_batches, records, run_cli, tiny_recipe

from convit_scale.config import DataConfig
from convit_scale.data import DataError, LoaderSpec, build_loader
from convit_scale.models import MODELS


@pytest.mark.parametrize("override, allowed", [("data.open_retries=-1", "must be >= 0"),
                                             ("data.max_bad_samples=-1", "must be >= 0"),
                                             ("data.open_retry_backoff_s=0.0", "must be > 0")])
def test_fault_settings_are_validated(override, allowed):
    from convit_scale.config import ConfigError, load_config

    assert (load_config().data.open_retries, load_config().data.max_bad_samples) == (3, 100)
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^<defaults> \(with overrides {override}\): {key} = {value} is not "
                                          rf"allowed; {allowed}$"):
        load_config(None, [override])


def _rewrite_shard(path, change) -> None:
    """Rewrite a tar shard with ``change(member_name, payload) -> payload`` applied to every member."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members:
            data = change(m.name, data)
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


def _truncate_last_jpeg(path) -> str:
    """Cut the shard in the middle of its last .jpg member; returns that sample's key."""
    with tarfile.open(path) as tar:
        last = [m for m in tar if m.name.endswith(".jpg")][-1]
    with open(path, "r+b") as f:
        f.truncate(last.offset_data + last.size // 2)
    return last.name.rsplit(".", 1)[0]


@pytest.fixture()
def broken_wds(fm_wds, tmp_path):
    """A copy of the session's shards with one corrupt JPEG (train shard 0) and one truncated member (the last
    sample of train shard 1); returns (folder, {(shard, key): reason word})."""
    out = tmp_path / "wds"
    shutil.copytree(fm_wds, out)
    shards = sorted(out.glob("train-*.tar"))
    with tarfile.open(shards[0]) as tar:
        corrupt = [m.name for m in tar if m.name.endswith(".jpg")][2]
    _rewrite_shard(shards[0], lambda name, data: data[: len(data) // 2] if name == corrupt else data)
    truncated = _truncate_last_jpeg(shards[1])
    _record_sizes(out)
    return out, {(str(shards[0]), corrupt.rsplit(".", 1)[0]): "undecodable", (str(shards[1]), truncated): "truncated"}


def _record_sizes(folder):
    """Damage that keeps the manifest's sizes (bit rot in place, a remote copy): preflight, which compares sizes
    before training, cannot see it, and the loader meets it during training."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for info in manifest["splits"].values():
        for name, rec in info["files"].items():
            if "bytes" in rec:
                rec["bytes"] = (folder / name).stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest))




def test_wds_corrupt_jpeg_and_truncated_member_are_replaced_counted_and_limited(broken_wds):
    path, expected = broken_wds
    d = DataConfig(format="wds", train_path=str(path), val_path=str(path), num_workers=0, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", 32, 50))
    first = epoch_batches(loader)
    assert len(first) == len(loader) and all(x.shape == (50, 3, 32, 32) and len(y) == 50 for x, y, _ in first)
    bad = [r for _, _, rs in first for r in rs]
    assert {(r["shard"], r["key"]): r["reason"].split()[0] for r in bad} == expected and len(bad) == 2
    # the same replacement after a resume at the first batch with a bad sample (and so on a rerun)
    k = next(i for i, (_, _, rs) in enumerate(first) if rs)
    again = epoch_batches(loader, 0, k)
    assert len(again) == len(first) - k
    for (x0, y0, b0), (x1, y1, b1) in zip(first[k:], again):
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and b0 == b1
    # past the limit: one line naming the shard of the sample that crossed it and the limit
    strict = build_loader(DataConfig(**{**d.__dict__, "max_bad_samples": 1}), LoaderSpec("train", 32, 50))
    with pytest.raises(DataError) as e:
        epoch_batches(strict)
    msg = str(e.value)
    assert "\n" not in msg and "data.max_bad_samples = 1" in msg and "2 unreadable samples in epoch 0" in msg
    assert any(msg.startswith(shard + ":") for shard, _ in expected)


def test_wds_evaluation_replaces_a_corrupt_jpeg_with_the_next_good_sample_of_its_batch(fm_wds, tmp_path):
    """Before: evaluation's replacement handed decode_chunk an index instead of an image, and a corrupt validation
    JPEG ended the evaluation in a TypeError."""
    out = tmp_path / "wds"
    shutil.copytree(fm_wds, out)
    shard = sorted(out.glob("val-*.tar"))[0]
    with tarfile.open(shard) as tar:
        jpgs = [m.name for m in tar if m.name.endswith(".jpg")]
    _rewrite_shard(shard, lambda name, data: data[: len(data) // 2] if name == jpgs[1] else data)
    _record_sizes(out)
    d = DataConfig(format="wds", train_path=str(out), val_path=str(out), num_workers=0)
    got = epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
    clean = epoch_batches(build_loader(DataConfig(**{**d.__dict__, "val_path": str(fm_wds)}),
                                       LoaderSpec("val", 32, 50)))
    bad = [r for _, _, rs in got for r in rs]
    assert [(r["key"], r["reason"].split()[0]) for r in bad] == [(jpgs[1].rsplit(".", 1)[0], "undecodable")]
    x, y, _ = got[0]  # the first batch: sample 1 is sample 2's image and label again, the others untouched
    x0, y0, _ = clean[0]
    assert torch.equal(x[1], x0[2]) and y[1] == y0[2] and torch.equal(x[2:], x0[2:]) and torch.equal(x[0], x0[0])
    assert sum(len(b[1]) for b in got) == sum(len(b[1]) for b in clean)


def test_training_logs_each_replaced_sample_with_its_shard_and_key(broken_wds, tmp_path):
    """One process, wds: the bad samples of the steps run appear in metrics.jsonl, as the loader lists them, and the
    first one on the console, once; so do the model.pretrained weights the run starts from."""
    from convit_scale.models import create_model

    path, _ = broken_wds
    shards = sorted(path.glob("train-*.tar"))
    for shard in shards[2:]:  # more corrupt JPEGs per shard, so that the first steps surely meet several
        with tarfile.open(shard) as tar:
            victims = set(sorted(m.name for m in tar if m.name.endswith(".jpg"))[:8])
        _rewrite_shard(shard, lambda name, data, victims=victims: b"not a jpeg" if name in victims else data)
    _record_sizes(path)
    d = DataConfig(format="wds", train_path=str(path), val_path=str(path), global_batch_size=32, num_workers=0,
                   repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", MODELS["convit_nano"].img_size, 32, global_batch_size=32,
                                       canonical_groups=d.groups))  # the run's canonical partitions
    expected = []
    for step, batch in enumerate(loader.epoch(0), 1):
        expected += [{"step": step, "epoch": 0, **r, "rank": 0} for r in batch.bad]
        if step == 3:
            break
    assert len(expected) > 1, "the first steps meet fewer than two bad samples: corrupt more"
    weights = tmp_path / "nano.pth"
    torch.save(create_model("convit_nano", num_classes=10).state_dict(), weights)
    r = tiny_recipe(tmp_path / "r.yaml", "wds", path, tmp_path / "out", data={"val_path": ""},
                    parallel={"strategy": "none"}, schedule={"max_steps": 3}, model={"pretrained": str(weights)})
    res = run_cli("train", "--recipe", str(r))
    assert res.returncode == 0, res.stderr[-3000:]
    logged = [{k: v for k, v in rec.items() if k != "kind"} for rec in records(tmp_path / "out", "bad_sample")]
    assert logged == expected
    said = [ln for ln in res.stdout.splitlines() if "replaced" in ln or "pretrained" in ln]
    first = expected[0]
    assert said == [f"[convit-scale] model.pretrained: convit_nano starts from the weights of {weights}",
                    f"[convit-scale] a training sample was replaced by another of its batch: {first['shard']}, key "
                    f"{first['key']} ({first['reason']}); said once: every replaced sample is a bad_sample record in "
                    f"metrics.jsonl, at most data.max_bad_samples = 100 per epoch and rank"], res.stdout


@pytest.mark.parametrize("split", ["train", "val"])
def test_ffcv_jpeg_that_fails_to_decode_takes_the_next_view_of_its_batch(fm_ffcv, tmp_path, split):
    """ffcv's decoders ignore turbojpeg's status (a corrupt JPEG becomes stale pixels); ours, training's and
    evaluation's, replace the view by the next one of the batch that decodes, with that view's label, and list it.
    Everything else is unchanged."""
    import dataclasses

    from ffcv.reader import Reader

    from convit_scale.data.ffcv_decoders import FILE_INDEX

    path = tmp_path / "ffcv"
    shutil.copytree(fm_ffcv, path)
    beton = next(path.glob(f"{split}*.beton"))
    reader = Reader(str(beton))
    ptr = int(reader.metadata[f"f{reader.field_names.index('image')}"]["data_ptr"][5])
    with open(beton, "r+b") as f:  # file 5: its JPEG's start-of-image marker overwritten
        f.seek(ptr)
        f.write(b"\0\0\0\0")
    d = DataConfig(format="ffcv", train_path=str(path), val_path=str(path), num_workers=1, repeated_aug=1)
    broken = build_loader(d, LoaderSpec(split, 32, 50))
    clean = build_loader(DataConfig(**{**d.__dict__, f"{split}_path": str(fm_ffcv)}), LoaderSpec(split, 32, 50))
    got, want = epoch_batches(broken), epoch_batches(clean)
    p = int(np.flatnonzero((broken.views(0) & FILE_INDEX) == 5)[0])
    k, i = divmod(p, 50)
    assert [b for _, _, b in got] == [[] for _ in range(k)] + [[{"file": str(beton), "key": 5, "reason":
                                                                  "undecodable JPEG (turbojpeg refused it)"}]] + \
        [[] for _ in range(len(got) - k - 1)]
    for n, ((x0, y0, _), (x1, y1, _)) in enumerate(zip(want, got)):
        same = torch.ones(len(y0), dtype=torch.bool)
        same[i] = n != k
        assert torch.equal(x0[same], x1[same]) and torch.equal(y0[same], y1[same]), n
    x, y, _ = got[k]
    assert y[i] == y[(i + 1) % 50] and not torch.equal(x[i], want[k][0][i])  # the next view's label and image
    if split == "val":  # no augmentation: the next view's very pixels
        assert torch.equal(x[i], want[k][0][(i + 1) % 50])
    again = epoch_batches(broken, 0, k)  # the same replacement after a resume
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got[k:], again))
    broken.d = dataclasses.replace(d, max_bad_samples=0)
    with pytest.raises(DataError, match=rf"^{beton}: 1 unreadable samples in epoch 0 on rank 0, more than "
                                        r"data.max_bad_samples = 0 \(last: key 5: undecodable JPEG"):
        epoch_batches(broken)
