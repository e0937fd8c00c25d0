"""The test helpers' own promises: a command started by ``run_group`` never outlives the wait for it."""
import os
import signal
import subprocess
import time

import pytest
from support import PY, run_group

# The command forks a grandchild into its group and both sleep; the grandchild writes its pid to a file.
SPAWN = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
         " print(c.pid, flush=True); time.sleep(600)")


class _Interrupted(BaseException):
    """What pytest-timeout raises inside a test: not an Exception, not a TimeoutExpired."""


def _gone(pid: int, within_s: float = 10) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by its parent (init) counts as gone
            if f.read().split(") ", 1)[1].startswith("Z"):
                return True
        time.sleep(0.1)
    return False


def _grandchild_pid(tmp_path) -> int:
    return int((tmp_path / "pid").read_text())


def test_run_group_kills_the_whole_group_past_its_time_limit(tmp_path):
    script = SPAWN.replace("print(c.pid, flush=True)", f"open({str(tmp_path / 'pid')!r}, 'w').write(str(c.pid))")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_group([PY, "-c", script], timeout=3)
    assert "the end of its output" in "".join(getattr(e.value, "__notes__", []))
    assert _gone(_grandchild_pid(tmp_path))


def test_run_group_kills_the_whole_group_when_the_wait_is_interrupted(tmp_path):
    script = SPAWN.replace("print(c.pid, flush=True)", f"open({str(tmp_path / 'pid')!r}, 'w').write(str(c.pid))")

    def interrupt(signum, frame):
        raise _Interrupted()

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3)
    started = time.monotonic()
    try:
        with pytest.raises(_Interrupted):
            run_group([PY, "-c", script], timeout=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 60  # the old code waited for the command: 600 s here, for ever on a hang
    assert _gone(_grandchild_pid(tmp_path))
