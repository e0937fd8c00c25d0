"""``prep index``: a manifest for WebDataset shards another tool wrote, so that they are trained on where they lie.

Each shard is read once, in parallel processes: its samples (members grouped by key, as webdataset groups them),
the label of each (a ``.cls`` member, or a field of the ``.json`` member: ``--label json:FIELD``) and so the samples
per class; no image is decoded. The manifest goes beside the shards, or into ``--out`` when their folder is read-only
(it then names the shards' folder as its ``root``). A shard's split is read from its name (``train``, ``val`` or
``validation`` in it) or given (``--split``). What such shards do not record (class names) is not guessed.
"""

from __future__ import annotations

import os
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from convit_scale.imagetree import PrepError
from convit_scale.manifest import MANIFEST, Manifest, Split, read_label

from .checks import class_counts

SPLIT_WORDS = {"train": ("train",), "val": ("val", "validation")}
"""The split of a shard whose name holds one of these words (timm's ``imagenet1k-validation-0001.tar``)."""


def _count(job: tuple[str, str]) -> tuple[str, int, dict, int, str | None]:
    """(shard, samples with an image and a readable label, {label: samples}, bytes, the first problem or None)."""
    path, label = job
    ext = label.partition(":")[0]
    labels, members, problem = [], {}, None

    def close(key):
        nonlocal problem
        m = members.pop(key, {})
        if "jpg" in m and ext in m:
            try:
                labels.append(read_label(m[ext], label))
                return
            except (ValueError, KeyError, TypeError) as e:
                why = f"unreadable label ({type(e).__name__}: {e})"
        else:
            why = f"no .{'jpg' if 'jpg' not in m else ext} member"
        problem = problem or f"sample {key!r}: {why}"

    try:
        with tarfile.open(path, "r|") as tar:
            key = None
            for member in tar:
                stem, _, member_ext = member.name.rpartition(".")
                if stem != key and key is not None:
                    close(key)
                key = stem
                if member_ext == ext:
                    members.setdefault(stem, {})[ext] = tar.extractfile(member).read()
                elif member_ext == "jpg":
                    members.setdefault(stem, {})["jpg"] = b""  # present; its bytes are not needed
            if key is not None:
                close(key)
    except (OSError, tarfile.TarError, EOFError) as e:
        raise PrepError(f"{path}: not a readable tar ({type(e).__name__}: {e}); allowed: WebDataset shards") from e
    return path, len(labels), class_counts(labels), os.path.getsize(path), problem


def _split_of(name: str, split: str | None) -> str:
    if split:
        return split
    words = name.lower().replace("_", "-").replace(".", "-").split("-")
    found = [s for s, names in SPLIT_WORDS.items() if any(w in words for w in names)]
    if len(found) != 1:
        raise PrepError(f"{name}: its split is not in its name (train, val or validation); allowed: --split NAME "
                        f"for a folder that holds one split")
    return found[0]


def index(src: str | Path, out: str | Path | None = None, label: str = "cls", split: str | None = None,
          workers: int = 1) -> Manifest:
    """Index the WebDataset shards (``*.tar``) of the folder ``src``; writes ``manifest.json`` into ``out`` (default:
    ``src``) and returns it. Samples without an image or a readable label are refused with the first one named:
    the loaders would have to skip them at every epoch."""
    src = Path(src)
    if not src.is_dir():
        raise PrepError(f"prep index {src}: not a folder; allowed: a folder of WebDataset shards (*.tar)")
    if label != "cls" and not (label.startswith("json:") and len(label) > len("json:")):
        raise PrepError(f"prep index --label {label!r}: allowed: cls (a KEY.cls member) or json:FIELD (a field of "
                        f"the KEY.json member)")
    shards = sorted(p for p in src.iterdir() if p.suffix == ".tar" and p.is_file())
    if not shards:
        raise PrepError(f"prep index {src}: no .tar shards in it")
    dest = Path(out) if out else src
    if (dest / MANIFEST).is_file():
        raise PrepError(f"{dest / MANIFEST} exists; allowed: a folder without a manifest (remove it to index again)")
    splits_of = {p.name: _split_of(p.name, split) for p in shards}
    dest.mkdir(parents=True, exist_ok=True)
    if not os.access(dest, os.W_OK):
        raise PrepError(f"prep index: {dest} is not writable; allowed: --out DIR, a folder of your own for the "
                        f"manifest (the shards stay where they are)")
    with ProcessPoolExecutor(max(1, min(workers, len(shards)))) as pool:
        counted = list(pool.map(_count, [(str(p), label) for p in shards]))
    problems = [f"{Path(p).name}: {why}" for p, _, _, _, why in counted if why]
    if problems:
        raise PrepError(f"{len(problems)} shard(s) with samples the loaders could not use; first: {problems[0]}")
    splits: dict[str, Split] = {}
    for path, n, per_class, size, _ in counted:
        s = splits.setdefault(splits_of[Path(path).name], Split(0, {}, {}))
        s.num_samples += n
        s.files[Path(path).name] = {"samples": n, "per_class": per_class, "bytes": size}
        for k, v in per_class.items():
            s.per_class[k] = s.per_class.get(k, 0) + v
    for s in splits.values():
        s.per_class = dict(sorted(s.per_class.items(), key=lambda kv: int(kv[0])))
    root = "" if dest.resolve() == src.resolve() else str(src.resolve())
    manifest = Manifest("wds", f"{src.resolve()} (indexed)", {"label": label, "indexed": True}, [], splits,
                        str(dest), root=root)
    manifest.write(dest)
    return manifest
