"""`prep index` (data_prep/index.py): shards another tool wrote, described where they lie (per-shard and per-class
counts from their own members, labels from a json field), local or streamed through a URL template; samples the
loaders could not use refused, naming the first."""

import json

import pytest
from support import records, tiny_recipe, train_here

from convit_scale.cli import main
from convit_scale.manifest import Manifest


@pytest.fixture(scope="module")
def json_shards(fm_tree, tmp_path_factory):
    """fm_tree as WebDataset shards another tool wrote without any description: KEY.jpg and KEY.json (the label a
    field of the json, no .cls member), split in the shards' names, no manifest, no _info.json."""
    import webdataset as wds

    root = tmp_path_factory.mktemp("json_wds")
    classes = sorted(p.name for p in (fm_tree / "train").iterdir() if p.is_dir())
    for split in ("train", "val"):
        items = [(p, label) for label, c in enumerate(classes) for p in sorted((fm_tree / split / c).iterdir())]
        with wds.ShardWriter(str(root / f"data-{split}-%03d.tar"), maxcount=400, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{split}{i:06d}", "jpg": path.read_bytes(),
                            "json": {"label": label, "wnid": classes[label]}})
    return root


def test_prep_index_describes_shards_where_they_lie_and_they_train(json_shards, tmp_path, capsys):
    """`prep index --label json:label --out DIR`: per-shard and per-class counts from the shards' own members, the
    manifest in DIR naming the shards' folder as its root; training, eval and verify read the shards from there."""
    idx = tmp_path / "index"
    assert main(["prep", "index", str(json_shards), "--out", str(idx), "--label", "json:label", "--workers", "2"]) == 0
    assert not (json_shards / "manifest.json").exists()
    m = Manifest.read(idx)
    assert m.root == str(json_shards.resolve()) and m.label_member == "json:label" and m.num_classes == 10
    assert m.split("train").per_class == {str(c): 100 for c in range(10)} and m.split("val").num_samples == 200
    assert [n for _, n in m.split("train").shards()] == [400, 400, 200]
    out = tmp_path / "run"
    r = tiny_recipe(tmp_path / "r.yaml", "wds", idx, out, schedule={"max_steps": 2},
                    log={"every_steps": 1, "progress": False, "debug_samples": True})
    assert train_here(r) == 0
    assert records(out, "eval")[-1]["samples"] == 200
    res = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out), "--data", str(idx), "--workers", "0", "--device", "cpu",
                 "--results-file", str(res)]) == 0
    per_class = json.loads(res.read_text())["per_class"]
    assert [c["images"] for c in per_class] == [20] * 10  # labels from the json field, every class its own
    from data_prep import verify

    assert verify(idx) == []
    capsys.readouterr()
    assert main(["prep", "index", str(json_shards), "--out", str(idx)]) != 0
    assert "exists; allowed: a folder without a manifest" in capsys.readouterr().err


def test_prep_index_refuses_samples_without_a_label_naming_the_first(json_shards, tmp_path):
    """Indexed with the default .cls labels, shards that have none are refused, naming a sample and what it lacks,
    and --label takes only what the loaders read."""
    from convit_scale.imagetree import PrepError
    from data_prep.index import index

    with pytest.raises(PrepError, match=r"shard\(s\) with samples the loaders could not use; first: data-train-000"
                                        r".*no \.cls member"):
        index(json_shards, tmp_path / "a", workers=2)
    with pytest.raises(PrepError, match="--label 'json': allowed: cls .* or json:FIELD"):
        index(json_shards, tmp_path / "b", label="json")
    with pytest.raises(PrepError, match=r"unreadable label \(KeyError"):
        index(json_shards, tmp_path / "c", label="json:target", workers=2)


def test_prep_index_streams_remote_shards_named_by_a_brace_pattern(json_shards, tmp_path):
    """A URL template (here a `pipe:` command, as `pipe:aws s3 cp s3://.../{name} -` would be) and the shards' names
    as a brace pattern: each shard streamed once, the manifest in --out naming the template; the loader then reads
    the shards through it. A command that fails is a failed shard, named."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader
    from convit_scale.imagetree import PrepError
    from data_prep.index import index

    remote = f"pipe:cat {json_shards}/{{name}}"
    m = index(remote, tmp_path / "idx", label="json:label", shards="data-train-{000..002}.tar", workers=2)
    assert m.root == remote and m.split("train").num_samples == 1000 and "bytes" not in m.split("train").files[
        "data-train-000.tar"]
    d = DataConfig(format="wds", train_path=str(tmp_path / "idx"), val_path=str(tmp_path / "idx"), num_workers=0,
                   repeated_aug=1, global_batch_size=40)
    batches = build_loader(d, LoaderSpec("train", 16, 40, global_batch_size=40)).epoch(0)
    first = next(batches)
    assert len(first.labels) == 40 and first.images.shape[-1] == 16
    batches.close()
    with pytest.raises(PrepError, match=r"data-train-003.tar: not a readable tar \(exit status 1: cat: .*No such file"):
        index(remote, tmp_path / "idx2", label="json:label", shards="data-train-{002..003}.tar")
    with pytest.raises(PrepError, match="remote shards cannot be listed; name them with --shards"):
        index(remote, tmp_path / "idx3")
