"""The fault rehearsal (convit_scale/rehearsal/faults.py): bad input refused in one line before any work."""

from __future__ import annotations


def test_the_fault_rehearsal_refuses_bad_input_in_one_line(capsys, tmp_path):
    from convit_scale.rehearsal.faults import main as fault_main

    assert fault_main(["--fault", "kill", "--signal-at", "9", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: --signal-at 9: allowed: 1 <= --signal-at < --steps (8)\n"
    assert not (tmp_path / "out").exists()
