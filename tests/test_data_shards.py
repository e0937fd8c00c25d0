"""WebDataset shards as streams (convit_scale/data/shards.py): a shard that fails to open or ends mid-stream is
opened again, up to ``data.open_retries`` times, then named in one line with the command's own failure."""

import pytest
import torch
from support import epoch_batches

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.manifest import SourceUnavailable


def _flaky_pipe(tmp_path, folder, when_failing: str) -> str:
    """A ``pipe:`` location whose command runs ``when_failing`` for the first two opens of a .tar shard (a
    counter file counts the opens), then streams the shard; the manifest always streams."""
    counter = tmp_path / "opens"
    counter.write_text("0")
    return (f"pipe:case {{name}} in *.tar) n=$(cat {counter}); echo $((n+1)) > {counter}; "
            f"if [ $n -lt 2 ]; then {when_failing}; fi;; esac; cat {folder}/{{name}}")


def test_a_pipe_that_fails_twice_then_streams_is_read(fm_wds, tmp_path):
    local = DataConfig(format="wds", train_path=str(fm_wds), val_path=str(fm_wds), num_workers=0)
    reference = epoch_batches(build_loader(local, LoaderSpec("val", 32, 50)))
    n_shards = len(list(fm_wds.glob("val-*.tar")))
    for when_failing, what in (("echo 'connection reset' >&2; exit 1", "open"),  # exits non-zero, no data
                               (f"head -c 5000 {fm_wds}/{{name}}; exit 0", "stream")):  # ends mid-shard
        url = _flaky_pipe(tmp_path, fm_wds, when_failing)
        d = DataConfig(**{**local.__dict__, "val_path": url, "open_retries": 2, "open_retry_backoff_s": 0.01})
        got = epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
        assert (tmp_path / "opens").read_text().strip() == str(n_shards + 2), what  # two failed tries, then one each
        assert len(got) == len(reference) and all(not b for _, _, b in got), what
        assert all(torch.equal(x0, x1) and torch.equal(y0, y1) for (x0, y0, _), (x1, y1, _) in zip(reference, got))
    # one retry is not enough: one line naming the shard, the tries and the command's failure
    url = _flaky_pipe(tmp_path, fm_wds, "echo 'connection reset' >&2; exit 3")
    d = DataConfig(**{**local.__dict__, "val_path": url, "open_retries": 1, "open_retry_backoff_s": 0.01})
    with pytest.raises(SourceUnavailable, match=r"^pipe:case .*val-\S+\.tar: could not be opened after 2 tries "
                                        r"\(exit status 3: connection reset\); data.open_retries = 1$"):
        epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))


def test_a_remote_shard_that_keeps_breaking_off_is_a_source_unavailable_not_bad_data(fm_wds, tmp_path):
    """A ``pipe:`` shard whose stream breaks off mid-shard at every try: the rest of its samples are replaced, with
    the reason that its stream broke off; past data.max_bad_samples that is ``SourceUnavailable`` (a store that may
    come back: a crash to the launcher), where a local shard's corruption is bad data."""
    from convit_scale.data import DataError

    url = (f"pipe:case {{name}} in *-000000.tar) head -c 5000 {fm_wds}/{{name}}; echo reset >&2; exit 56;; "
           f"*) cat {fm_wds}/{{name}};; esac")
    local = DataConfig(format="wds", train_path=str(fm_wds), val_path=str(fm_wds), num_workers=0)
    d = DataConfig(**{**local.__dict__, "val_path": url, "open_retries": 1, "open_retry_backoff_s": 0.01,
                      "max_bad_samples": 1000})
    got = epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
    reasons = {r["reason"].split(" after ")[0] for _, _, bad in got for r in bad}
    assert reasons == {"the stream broke off"}, reasons
    d = DataConfig(**{**d.__dict__, "max_bad_samples": 5})
    with pytest.raises(SourceUnavailable, match=r"more than data.max_bad_samples = 5 .*the stream broke off"):
        epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
    # a remote shard whose command ends well but short: its bytes, not their transport
    short = url.replace("echo reset >&2; exit 56", "exit 0")
    d = DataConfig(**{**d.__dict__, "val_path": short})
    with pytest.raises(DataError, match="truncated or corrupt shard") as refused:
        epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
    assert type(refused.value) is DataError
    shard = sorted(fm_wds.glob("val-*.tar"))[0]
    for name, cut in (("local", 5000), ("not-a-tar", 100)):  # truncated mid-shard; no tar from its first byte
        broken = tmp_path / name
        broken.mkdir()
        for f in fm_wds.iterdir():
            (broken / f.name).write_bytes(f.read_bytes()[:cut] if f == shard else f.read_bytes())
        d = DataConfig(**{**local.__dict__, "val_path": str(broken), "max_bad_samples": 5})
        with pytest.raises(DataError, match="truncated or corrupt shard|could not be opened") as refused:
            epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
        assert type(refused.value) is DataError, name


def test_a_shard_that_never_opens_in_a_loader_worker_is_named_in_one_line(fm_wds, tmp_path):
    """Raised in a loader worker process, torch's DataLoader raises it again with the worker's traceback as its
    message: the rank's error line and heartbeat still say the worker's one line (``errors.message``)."""
    from convit_scale.errors import message
    from convit_scale.train.engine import _outcome

    url = _flaky_pipe(tmp_path, fm_wds, "echo 'connection reset' >&2; exit 3")
    d = DataConfig(format="wds", train_path=str(fm_wds), val_path=url, num_workers=1, open_retries=1,
                   open_retry_backoff_s=0.01)
    with pytest.raises(SourceUnavailable) as raised:
        epoch_batches(build_loader(d, LoaderSpec("val", 32, 50)))
    assert "DataLoader worker process" in str(raised.value)  # torch's wrapping, as a rank meets it
    line = message(raised.value)
    assert "\n" not in line and line.endswith("could not be opened after 2 tries (exit status 3: connection reset); "
                                              "data.open_retries = 1"), line
    assert _outcome(raised.value) == f"failed: SourceUnavailable: {line}"[:len("failed: SourceUnavailable: ") + 300]
