"""A process whose entry point is convit-scale's (a rank: ``python -m convit_scale.train``; the ``convit-scale``
command): its cyclic garbage collector at start and at exit.

torch, timm and torchvision make millions of objects on import that live as long as the process. Collecting while
they are made, and once more over all of them at interpreter exit, costs each process about 0.6 s and 0.8 s of CPU
(2-core machine): minutes for a node's ranks, whose start and end are the job's, and for the suite. So the entry
point holds the collector off while it imports (``importing``), then freezes what the imports made (``gc.freeze``:
never scanned again) and turns it back on (``imported``); that also keeps a forked DataLoader worker's collections from
writing into the pages it shares with its rank (the start-up Python's ``gc.freeze`` documents). At exit
(``exiting``), after the run has closed its files, loaders and process groups, the last collection over the long-lived
objects is skipped; atexit handlers and weakref finalizers run as before.

A library caller's process is not touched: only the entry points call these."""

from __future__ import annotations

import gc


def importing() -> None:
    """Before the entry point's imports."""
    gc.disable()


def imported() -> None:
    """After them: what they made is frozen, and the collector runs again for what the process makes from now."""
    gc.freeze()
    gc.enable()


def exiting(code: int) -> int:
    """The process's exit status, after freezing what is still alive: no collection over it at interpreter exit."""
    gc.freeze()
    return code
