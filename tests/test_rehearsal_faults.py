"""The fault rehearsal (convit_scale/rehearsal/faults.py): bad input refused in one line before any work."""

from __future__ import annotations


def test_the_fault_rehearsal_refuses_bad_input_in_one_line(capsys, tmp_path):
    from convit_scale.rehearsal.faults import main as fault_main

    assert fault_main(["--fault", "kill", "--signal-at", "9", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: --signal-at 9: allowed: 1 <= --signal-at < --steps (8)\n"
    assert not (tmp_path / "out").exists()


def test_only_fresh_heartbeats_of_the_newest_start_name_pids_to_signal(tmp_path):
    """A rank killed in an earlier start left its heartbeat, naming a pid that may since be another process's: the
    fault injection (and the Slurm fault tests) signal only the ranks of the newest start that wrote a second ago."""
    import json
    import os
    import subprocess
    import time

    from convit_scale.rehearsal.faults import children, live_ranks

    beats, now = tmp_path / "heartbeat", time.time()
    beats.mkdir()
    for rank, launch, born, alive, state in [(0, "b", now - 50, now - 0.5, "running"),  # this start's
                                             (1, "a", now - 99, now - 60, "running"),  # killed in the last one
                                             (2, "b", now - 50, now - 30, "running"),  # this start's, silent
                                             (3, "b", now - 50, now - 0.2, "finished")]:
        (beats / f"rank_{rank}.json").write_text(json.dumps({"rank": rank, "launch": launch, "born": born,
                                                             "alive": alive, "state": state, "pid": 1}))
    assert list(live_ranks(tmp_path, heartbeat_s=1)) == [0]
    assert live_ranks(tmp_path / "elsewhere", heartbeat_s=1) == {}
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert sleeper.pid in children(os.getpid())
    finally:
        sleeper.kill()
        sleeper.wait()
