"""``prep index``: a manifest for WebDataset shards another tool wrote, so that they are trained on where they lie.

Each shard is read once, in parallel processes: its samples (members grouped by key, as webdataset groups them),
the label of each (a ``.cls`` member, or a field of the ``.json`` member: ``--label json:FIELD``) and so the samples
per class; no image is decoded. The manifest goes beside the shards, or into ``--out`` when their folder is read-only
(it then names the shards' folder as its ``root``). Remote shards (a URL template with ``{name}``: ``pipe:aws s3 cp
s3://bucket/imagenet/{name} -``, ``https://host/imagenet/{name}``, as the loaders take them) are streamed once, their
names given as a brace pattern (``--shards 'imagenet-train-{000000..001281}.tar'``), the manifest written into
``--out``. A shard's split is read from its name (``train``, ``val`` or ``validation`` in it) or given (``--split``).
What such shards do not record (class names) is not guessed.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from braceexpand import braceexpand

from convit_scale.imagetree import PrepError
from convit_scale.manifest import MANIFEST, Manifest, Split, read_label, split_in_name
from convit_scale.streams import CommandStream, open_stream

from .checks import class_counts, worker_pool


def _count(job: tuple[str, str, str]) -> tuple[str, int, dict, int | None, str | None]:
    """(shard name, samples with an image and a readable label, {label: samples}, bytes (local shards), the first
    problem or None) of the shard at ``url``."""
    name, url, label = job
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

    stream = None
    try:
        stream = open_stream(url)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
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
        if isinstance(stream, CommandStream):
            stream.finish()  # a command that failed is a failed read, even when its output looked complete
    except (OSError, tarfile.TarError, EOFError) as e:
        failure = stream.failure(wait=True) if isinstance(stream, CommandStream) else None  # the command's own reason
        raise PrepError(f"{url}: not a readable tar ({failure or f'{type(e).__name__}: {e}'}); allowed: WebDataset "
                        f"shards") from e
    finally:
        if stream is not None:
            stream.close()
    return name, len(labels), class_counts(labels), os.path.getsize(url) if os.path.isfile(url) else None, problem


def _split_of(name: str, split: str | None) -> str:
    if split:
        return split
    found = split_in_name(name)
    if found is None:
        raise PrepError(f"{name}: its split is not in its name (train, val or validation); allowed: --split NAME "
                        f"for a folder that holds one split")
    return found


def _shard_names(src: str, pattern: str | None) -> list[str]:
    """The shards to index: the brace pattern's names, or a local folder's ``*.tar``."""
    if pattern:
        return list(braceexpand(pattern))
    if "{name}" in src:
        raise PrepError(f"prep index {src}: remote shards cannot be listed; name them with --shards PATTERN (a brace "
                        f"pattern: 'imagenet-train-{{000000..001281}}.tar')")
    if not Path(src).is_dir():
        raise PrepError(f"prep index {src}: not a folder; allowed: a folder of WebDataset shards (*.tar), or a URL "
                        f"template with {{name}} and --shards")
    names = sorted(p.name for p in Path(src).iterdir() if p.suffix == ".tar" and p.is_file())
    if not names:
        raise PrepError(f"prep index {src}: no .tar shards in it")
    return names


def index(src: str | Path, out: str | Path | None = None, label: str = "cls", split: str | None = None,
          workers: int = 1, shards: str | None = None) -> Manifest:
    """Index the WebDataset shards of ``src`` (a folder: its ``*.tar``, or those ``shards`` names; a URL template
    with ``{name}``: the ``shards`` brace pattern's); writes ``manifest.json`` into ``out`` (default: a local
    ``src``) and returns it. Samples without an image or a readable label are refused with the first one named:
    the loaders would have to skip them at every epoch."""
    src = str(src)
    remote = "{name}" in src
    if label != "cls" and not (label.startswith("json:") and len(label) > len("json:")):
        raise PrepError(f"prep index --label {label!r}: allowed: cls (a KEY.cls member) or json:FIELD (a field of "
                        f"the KEY.json member)")
    if remote and not out:
        raise PrepError(f"prep index {src}: remote shards: name a local folder for the manifest with --out DIR")
    names = _shard_names(src, shards)
    dest = Path(out) if out else Path(src)
    if (dest / MANIFEST).is_file():
        raise PrepError(f"{dest / MANIFEST} exists; allowed: a folder without a manifest (remove it to index again)")
    splits_of = {n: _split_of(n, split) for n in names}
    dest.mkdir(parents=True, exist_ok=True)
    if not os.access(dest, os.W_OK):
        raise PrepError(f"prep index: {dest} is not writable; allowed: --out DIR, a folder of your own for the "
                        f"manifest (the shards stay where they are)")
    jobs = [(n, src.format(name=n) if remote else str(Path(src) / n), label) for n in names]
    with worker_pool(max(1, min(workers, len(jobs)))) as pool:
        counted = list(pool.map(_count, jobs))
    problems = [f"{name}: {why}" for name, _, _, _, why in counted if why]
    if problems:
        raise PrepError(f"{len(problems)} shard(s) with samples the loaders could not use; first: {problems[0]}")
    splits: dict[str, Split] = {}
    for name, n, per_class, size, _ in counted:
        s = splits.setdefault(splits_of[name], Split(0, {}, {}))
        s.num_samples += n
        s.files[name] = {"samples": n, "per_class": per_class, **({"bytes": size} if size is not None else {})}
        for k, v in per_class.items():
            s.per_class[k] = s.per_class.get(k, 0) + v
    for s in splits.values():
        s.per_class = dict(sorted(s.per_class.items(), key=lambda kv: int(kv[0])))
    root = src if remote else "" if dest.resolve() == Path(src).resolve() else str(Path(src).resolve())
    where = src if remote else str(Path(src).resolve())
    manifest = Manifest("wds", f"{where} (indexed)", {"label": label, "indexed": True}, [], splits, str(dest),
                        root=root)
    manifest.write(dest)
    return manifest
