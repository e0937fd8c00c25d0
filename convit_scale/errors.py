"""Bad input: what the user can fix, as opposed to a bug.

``BadInput`` is raised where input is checked (a recipe key, a flag, a file or folder, data, a checkpoint): each
command reports it as one line ``error: <message>`` and exit status 2, and a training rank ends with status 2, which
the Slurm launcher does not restart. Its kinds: ``config.ConfigError`` (a recipe), ``manifest.DataError`` (data),
``imagetree.PrepError`` (a source to convert), ``models.weights.WeightsMismatch`` (weights),
``train.checkpoint.CheckpointIncompatible`` (a checkpoint to resume). Every other exception, a ``ValueError`` of
the code or of a library included, is a bug: a traceback, and in a job a crash the launcher handles as one.
"""

from __future__ import annotations


class BadInput(Exception):
    """Input the user can fix: the message names the key, flag or path and what is allowed, in one line."""


def message(e: BaseException) -> str:
    """``str(e)``; for an error torch's DataLoader raised again from a worker process (a shard that did not open in a
    loader worker: its message is "Caught X in DataLoader worker process N." and the worker's whole traceback), the
    worker's own message, the traceback's last line past the error's name."""
    text = str(e)
    if not (text.startswith("Caught ") and " in DataLoader worker process " in text and "\nOriginal Traceback" in text):
        return text
    last = text.rstrip().splitlines()[-1]
    name, sep, rest = last.partition(": ")
    return rest if sep and name.rsplit(".", 1)[-1] == type(e).__name__ else last


__all__ = ["BadInput", "message"]
