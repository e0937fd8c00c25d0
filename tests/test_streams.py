"""A shard's bytes as a stream (convit_scale/streams.py): a local file, or a command's output whose exit status and
last line of standard error decide whether the read failed, even when the output looks complete."""

from __future__ import annotations

import pytest

from convit_scale.streams import CommandStream, open_stream, shard_url


def test_a_shards_url_at_a_folder_or_a_template():
    assert shard_url("/data/wds", "train-000.tar") == "/data/wds/train-000.tar"
    assert shard_url("pipe:aws s3 cp s3://b/{name} -", "train-000.tar") == "pipe:aws s3 cp s3://b/train-000.tar -"


def test_a_local_file_and_a_commands_output_read_the_same_bytes(tmp_path):
    data = bytes(range(256)) * 1000
    (tmp_path / "s.tar").write_bytes(data)
    with open_stream(str(tmp_path / "s.tar")) as f:
        assert f.read() == data
    stream = open_stream(f"pipe:cat {tmp_path / 's.tar'}")
    assert isinstance(stream, CommandStream) and stream.read() == data
    stream.finish()  # exit status 0: no error
    stream.close()


def test_a_command_that_fails_is_a_failed_read_naming_its_status_and_last_error_line(tmp_path):
    (tmp_path / "s.tar").write_bytes(b"x" * 100)
    stream = open_stream(f"pipe:cat {tmp_path / 's.tar'}; echo 'first' >&2; echo 'access denied' >&2; exit 4")
    assert stream.read() == b"x" * 100  # the output looks complete
    with pytest.raises(OSError, match=r"^exit status 4: access denied$"):
        stream.finish()
    stream.close()
    quiet = CommandStream("exit 3")
    assert quiet.failure(wait=True) == "exit status 3"
    quiet.close()
    endless = CommandStream("yes")  # left early, as a range that ends inside a shard: killed, not a failure
    assert endless.read(10) == b"y\ny\ny\ny\ny\n"
    endless.close()
    assert endless.proc.returncode is not None


def test_a_command_that_stops_sending_is_a_failed_read_not_a_wait_for_ever(tmp_path):
    """A hung mount or a server that stopped sending: after ``stall_s`` without a byte, the read fails (an OSError,
    which the loaders retry and prep refuses), the command is killed, and the failure says it stalled."""
    import time

    stream = CommandStream("printf 'abc'; sleep 30", stall_s=0.5)
    t0 = time.monotonic()
    assert stream.read(3) == b"abc"  # what came is delivered
    with pytest.raises(OSError, match=r"no bytes for 0.5 s from: printf 'abc'; sleep 30"):
        stream.read(10)
    assert time.monotonic() - t0 < 5
    assert stream.failure(wait=True) == "stalled: no bytes for 0.5 s (killed)"
    stream.close()
    assert stream.proc.returncode is not None


def test_a_read_of_n_bytes_gathers_them_across_the_pipes_chunks():
    stream = CommandStream("printf 'ab'; sleep 0.2; printf 'cdef'")
    assert stream.read(5) == b"abcde" and stream.read(10) == b"f" and stream.read(1) == b""
    stream.finish()
    stream.close()
