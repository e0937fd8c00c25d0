"""A WebDataset shard's bytes as a stream, wherever it is: a local file, the output of a shell command (a ``pipe:``
URL, or curl for http(s)) whose exit status and standard error are checked, or any URL webdataset opens. Read by the
loaders (``data/shards.py``) and by ``prep index`` (``data_prep/index.py``)."""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import tempfile
from pathlib import Path

STALL_S = 120.0
"""A command that has delivered no byte for this long has stalled (a hung mount, a server that stopped sending, a
credential prompt nobody answers): its read fails, as a failed read (retried by the loaders, refused by prep)."""


def shard_url(location: str, name: str) -> str:
    """The URL or path of shard ``name`` at ``location`` (what errors and ``Batch.bad`` name)."""
    return location.format(name=name) if "{name}" in location else str(Path(location) / name)


class CommandStream:
    """The standard output of a shell command (a ``pipe:`` URL, or curl for http(s)), whose exit status and
    standard error are checked: a command that fails is a failed read even when its output looks complete."""

    def __init__(self, command: str, stall_s: float = STALL_S):
        self.command, self.stderr = command, tempfile.TemporaryFile()  # a file: a chatty command never blocks
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr)
        self.stall_s, self.stalled = stall_s, False

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all of them for -1), fewer only at the end; a TimeoutError (an OSError) when the
        command delivers nothing for ``stall_s``: it is killed, and ``failure`` says it stalled."""
        fd, chunks, left = self.proc.stdout.fileno(), [], size
        while left != 0:
            if not select.select([fd], [], [], self.stall_s)[0]:
                self.stalled = True
                self.proc.kill()
                raise TimeoutError(f"no bytes for {self.stall_s:g} s from: {self.command}")
            chunk = os.read(fd, 1 << 20 if left < 0 else min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left = left - len(chunk) if left > 0 else left
        return b"".join(chunks)

    def failure(self, wait: bool = False) -> str | None:
        """"exit status N: <last line of stderr>" once the command has failed, else None; "stalled: ..." for one
        that delivered nothing for ``stall_s`` (killed)."""
        if self.stalled:
            self.proc.wait()
            return f"stalled: no bytes for {self.stall_s:g} s (killed)"
        status = self.proc.wait() if wait else self.proc.poll()
        if not status:
            return None
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read()[-2000:].decode(errors="replace").splitlines()]
        last = next((line for line in reversed(lines) if line), "")
        return f"exit status {status}" + (f": {last}" if last else "")

    def finish(self) -> None:
        """At the end of the archive: read what is left, wait, and raise OSError if the command failed."""
        while self.read(1 << 16):
            pass
        failure = self.failure(wait=True)
        if failure:
            raise OSError(failure)

    def close(self) -> None:
        if self.proc.poll() is None:  # left early (the range ended inside the shard): not a failure
            self.proc.kill()
        self.proc.stdout.close()
        self.proc.wait()
        self.stderr.close()


def open_stream(url: str):
    if url.startswith("pipe:"):
        return CommandStream(url[len("pipe:"):])
    if url.startswith(("http://", "https://")):
        return CommandStream(f"curl -fsS -L --connect-timeout 30 {shlex.quote(url)}")
    if "://" in url:
        from webdataset.gopen import gopen  # what else webdataset opens (it imports torch: only when asked)

        return gopen(url, "rb")
    return open(url, "rb")
