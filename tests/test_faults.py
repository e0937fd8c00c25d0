"""The launcher's diagnosis of a failed training step and its decision (restart, requeue, stop), from heartbeats,
hang reports and srun's or torchrun's messages written as the real ones are."""

import json
import time

from convit_scale import faults

SRUN = """[rank0]: RuntimeError: Connection closed by peer
srun: error: n2: task 1: Killed
srun: error: n1: task 0: Exited with exit code 1
"""
TORCHRUN = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_10:00:00
  host      : n3
  rank      : 5 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
"""


def _beat(rank, step, phase, node, state="running", alive=None):
    now = time.time()
    return {"rank": rank, "node": node, "step": step, "phase": phase, "since": now - 3, "alive": alive or now,
            "pid": 10 + rank, "state": state, "launch": "x"}


def _run(tmp_path, *steps):
    out = tmp_path / "run"
    for s in steps:
        (out / "checkpoints" / f"step_{s:09d}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{s:09d}" / "meta.json").write_text("{}")
    return out


def test_the_first_failed_task_as_srun_and_torchrun_report_it():
    assert faults.first_failed_task(SRUN) == {"rank": 1, "node": "n2", "signal": 9, "exit_status": None,
                                              "how": "Killed"}
    t = faults.first_failed_task(TORCHRUN)
    assert (t["rank"], t["node"], t["signal"]) == (5, "n3", 9)
    assert faults.first_failed_task("no failure here") is None


def test_kinds_of_fault():
    beats = [_beat(0, 31, "reduction", "n1", "failed: RuntimeError: Connection closed"), _beat(1, 31, "data", "n2")]
    crash = faults.classify(137, beats, [], faults.first_failed_task(SRUN), SRUN, [])
    assert (crash["kind"], crash["rank"], crash["node"], crash["signal"]) == ("crash", 1, "n2", 9)
    assert faults.describe(crash).startswith("fault: crash (signal 9) of rank 1 on n2 in step 32 (data)")
    oom = faults.classify(1, [_beat(0, 3, "forward/backward", "n1", "failed: OutOfMemoryError: CUDA out of memory")],
                          [], None, "", [])
    assert oom["kind"] == "oom" and faults.describe(oom).startswith("fault: out of memory of rank 0 on n1 in step 4")
    lost = faults.classify(137, beats, [], faults.first_failed_task(SRUN), SRUN, ["n2"])
    assert (lost["kind"], lost["node"], lost["ranks"]) == ("node_lost", "n2", [1])
    now = time.time()
    hang = {"time": now, "step": 31, "phase": "reduction", "since": now - 6, "rank": 0, "summary": "rank 1 ...",
            "culprits": [{"rank": 1, "node": "n2"}], "waiting": [{"rank": 0}], "stacks": "s.txt",
            "children": [{"pid": 99, "state": "T"}]}
    h = faults.classify(76, [_beat(0, 31, "reduction", "n1"), _beat(1, 31, "forward/backward", "n2")], [hang],
                        None, "", [])
    assert (h["kind"], h["rank"], h["node"], h["waiting"]) == ("hang", 1, "n2", [0]) and h["stopped_workers"]
    assert "ranks 0 were waiting for it; stopped loader worker(s) 99" in faults.describe(h)
    hang["children"] = [{"pid": 98, "state": "S", "wchan": "futex_wait_queue"},  # a lock it inherited at the fork
                        {"pid": 97, "state": "S", "wchan": "do_sys_poll"}]  # idle on its queue
    h = faults.classify(76, [_beat(0, 31, "reduction", "n1"), _beat(1, 31, "data", "n2")], [hang], None, "", [])
    assert [c["pid"] for c in h["locked_workers"]] == [98] and not h["stopped_workers"]
    assert faults.describe(h).endswith("; loader worker(s) waiting on a lock (futex) 98")


def test_data_refused_mid_run_stops_the_job_whatever_status_the_launcher_reports(tmp_path, capsys):
    """A rank that refused its data during training (a DataError, exit 2) while srun ended the others (the step's
    status a signal's) or torchrun reported 1: the input refused, not a crash; no restart repeats it, even after
    progress."""
    srun = "srun: error: n1: task 0: Exited with exit code 2\nsrun: error: n2: task 1: Killed\n"
    assert faults.first_failed_task(srun)["exit_status"] == faults.EXIT_BAD_INPUT
    why = "DataError: step 12: the device's decoder (cuda:0) refused all 256 JPEGs of a batch that PIL decodes"
    beats = [_beat(0, 11, "forward/backward", "n1", f"failed: {why}"), _beat(1, 11, "reduction", "n2")]
    for rc, log, task in ((137, srun, faults.first_failed_task(srun)), (1, "", None)):
        rec = faults.classify(rc, beats, [], task, log, [])
        assert (rec["kind"], rec["rank"], rec["node"]) == ("refused", 0, "n1"), rec
        assert faults.describe(rec).startswith("fault: input refused of rank 0 on n1 in step 12") and why in \
            faults.describe(rec)
    out = _run(tmp_path, 10)
    faults.start(out, "7", 0, [])
    _run(tmp_path, 12)  # progress since the start: a crash would be restarted
    (out / "heartbeat").mkdir()
    (out / "heartbeat" / "rank_0.json").write_text(json.dumps(beats[0]))
    assert faults.end(out, 137, srun, [], max_restarts=10) == "stop"
    assert "a restart would refuse them again" in capsys.readouterr().err


def test_a_source_that_could_not_be_reached_is_a_crash_restarted_after_progress(tmp_path, capsys, monkeypatch):
    """A shard that did not open after its retries (a store or file system that is down) may come back: the rank
    ends as a crash (exit 1, ``SourceUnavailable``), not as input refused, and the job restarts where it made
    progress."""
    from convit_scale.manifest import SourceUnavailable
    from convit_scale.train import engine

    def unreachable(cfg):
        raise SourceUnavailable("pipe:curl -s https://store/{name}: train-000042.tar: could not be opened after 4 "
                                "tries (exit status 6: could not resolve host)")

    monkeypatch.setattr(engine, "train", unreachable)
    assert engine.exit_status(None) == 1
    assert "error: pipe:curl" in capsys.readouterr().err
    why = "SourceUnavailable: pipe:curl -s https://store/{name}: train-000042.tar: could not be opened after 4 tries"
    beats = [_beat(0, 11, "data", "n1", f"failed: {why}"), _beat(1, 11, "reduction", "n2")]
    srun = "srun: error: n1: task 0: Exited with exit code 1\nsrun: error: n2: task 1: Killed\n"
    rec = faults.classify(137, beats, [], faults.first_failed_task(srun), srun, [])
    assert (rec["kind"], rec["rank"]) == ("crash", 0), rec
    out = _run(tmp_path, 10)
    faults.start(out, "", 0, [])
    _run(tmp_path, 12)
    (out / "heartbeat").mkdir()
    (out / "heartbeat" / "rank_0.json").write_text(json.dumps(beats[0]))
    assert faults.end(out, 137, srun, [], max_restarts=10) == "restart"


def test_no_answer_from_squeue_leaves_the_decision_to_the_fault(tmp_path, monkeypatch):
    """No ``squeue`` on the node, or one that does not answer: no time left is known (None), nothing raised."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert faults.job_time_left("7") is None
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\nexec sleep 30\n")
    squeue.chmod(0o755)
    monkeypatch.setattr(faults, "SQUEUE_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    assert faults.job_time_left("7") is None and time.monotonic() - t0 < 10
    squeue.write_text("#!/bin/sh\necho 1-02:03:04\n")
    assert faults.job_time_left("7") == 93784


def test_a_restart_needs_a_newer_checkpoint_so_the_same_failure_twice_ends_the_job(tmp_path, capsys):
    out = _run(tmp_path, 30)
    faults.start(out, "7", 0, [])
    (out / "heartbeat").mkdir()
    (out / "heartbeat" / "rank_1.json").write_text(json.dumps(_beat(1, 32, "data", "n2")))
    assert faults.end(out, 137, SRUN, [], max_restarts=10) == "stop"  # no checkpoint newer than at the start (30)
    _run(tmp_path, 33)
    faults.start(out, "7", 0, [])
    (out / "heartbeat" / "rank_1.json").write_text(json.dumps(_beat(1, 34, "data", "n2")))
    _run(tmp_path, 36)
    assert faults.end(out, 137, SRUN, [], max_restarts=10) == "restart"
    rec = faults.recovered(out, resumed_from=36, step=37)
    assert rec["first_new_step"] == 37 and rec["back_s"] >= 0 and faults.recovered(out, 36, 38) is None
    faults.start(out, "7", 0, [])
    (out / "heartbeat" / "rank_1.json").write_text(json.dumps(_beat(1, 36, "data", "n2")))
    assert faults.end(out, 137, SRUN, [], max_restarts=10) == "stop"
    err = capsys.readouterr().err
    assert "== fault: crash (signal 9) of rank 1 on n2 in step" in err and "resuming from checkpoint step 36" in err
    assert err.strip().splitlines()[-1].startswith("error: fault: crash (signal 9) of rank 1 on n2 in step 37 (data)")
    assert "no checkpoint newer than at this start (step 36)" in err
    recs = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert [r["action"] for r in recs] == ["stop", "restart", "stop"] and recs[1]["steps_redone"] == 0


def test_a_restart_too_near_the_time_limit_is_a_requeue():
    """Under the scripts' signal lead before the time limit, the pre-timeout signal was already sent: a new step in
    the allocation would train unsaved until the limit kills it (and a job its limit ends is not requeued), so the
    job requeues instead. Slurm's time left is read as squeue prints it."""
    rec, begun = {"kind": "crash", "checkpoint_step": 40}, {"checkpoint_step": 20}
    assert faults.decide(rec, begun, [], 0, 10, [], time_left=None)[0] == "restart"  # no limit, or no answer
    assert faults.decide(rec, begun, [], 0, 10, [], time_left=faults.RESTART_MIN_TIME_LEFT_S)[0] == "restart"
    # Slurm may send the signal up to 60 s early, and a start takes time to reach its first step
    assert faults.RESTART_MIN_TIME_LEFT_S >= faults.SIGNAL_LEAD_S + 60 + 60
    action, why = faults.decide(rec, begun, [], 0, 10, [], time_left=faults.SIGNAL_LEAD_S + 30)
    assert action == "requeue" and why.startswith("330 s left before the time limit") and "step 40" in why
    assert faults.decide(rec, {"checkpoint_step": 40}, [], 0, 10, [], time_left=120)[0] == "stop"  # no progress
    assert [faults.parse_time_left(t) for t in ("4:05", "1:00:00", "2-03:04:05", "59", "UNLIMITED", "NOT_SET",
                                                "", "INVALID")] == [245, 3600, 183845, 59, None, None, None, 0]


def test_a_start_that_ended_unseen_is_recorded_as_a_lost_node(tmp_path, capsys):
    out = _run(tmp_path, 3)
    faults.start(out, "7", 0, ["n1", "n2"])
    (out / "heartbeat").mkdir()
    (out / "heartbeat" / "rank_1.json").write_text(json.dumps(_beat(1, 4, "data", "n2", alive=time.time() - 60)))
    (out / "heartbeat" / "rank_0.json").write_text(json.dumps(_beat(0, 4, "reduction", "n1")))
    faults.start(out, "7", 1, ["n1"])  # Slurm requeued the job: the launcher never saw the step end
    (rec,) = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert (rec["kind"], rec["rank"], rec["node"]) == ("node_lost", 1, "n2")
    assert "fault: node lost of rank 1 on n2" in capsys.readouterr().err


def test_a_start_closed_by_its_launcher_is_no_lost_node_at_the_next_start(tmp_path, capsys):
    """A step that stopped for its requeue (or finished) is closed by the launcher (``faults close``, as
    slurm/launch.sh calls it): the requeued job's next start records no fault."""
    out = _run(tmp_path, 3)
    assert faults.main(["start", "--out", str(out), "--job", "7", "--nodes", "n1,n2"]) == 0
    assert faults.main(["close", "--out", str(out), "--outcome", "stopped"]) == 0
    assert faults.main(["start", "--out", str(out), "--job", "7", "--restart", "1", "--nodes", "n1"]) == 0
    assert not (out / "faults.jsonl").exists() and "fault" not in capsys.readouterr().err
    starts = [json.loads(line) for line in (out / "faults_starts.jsonl").read_text().splitlines()]
    assert [s.get("outcome") for s in starts] == ["stopped", None]


def test_the_launchers_first_failure_and_a_lost_node_come_before_a_watchdogs_report_of_silence():
    """Rank 0's watchdog reports a rank whose heartbeat stopped; that rank may have been killed (srun's first failure
    is its death by a signal: a crash) or stopped (srun's first failure is rank 0's exit after its report: a hang),
    or its node may be gone (a lost node, whatever the watchdogs reported)."""
    now = time.time()
    silent = {"time": now, "step": 4, "phase": "checkpoint save", "since": now - 70, "rank": 0, "limit_s": 60,
              "summary": "rank 1 on n2 stopped responding", "culprits": [{"rank": 1, "node": "n2"}],
              "waiting": [{"rank": 0}], "stacks": "s.txt", "children": []}
    beats = [_beat(0, 4, "checkpoint save", "n1"), _beat(1, 4, "checkpoint save", "n2", alive=now - 70)]
    killed = faults.classify(137, beats, [silent], faults.first_failed_task(SRUN), SRUN, [])
    assert (killed["kind"], killed["rank"], killed["signal"]) == ("crash", 1, 9)
    stopped_log = "srun: error: n1: task 0: Exited with exit code 76\nsrun: error: n2: task 1: Killed\n"
    stopped = faults.classify(76, beats, [silent], faults.first_failed_task(stopped_log), stopped_log, [])
    assert (stopped["kind"], stopped["rank"], stopped["node"], stopped["phase"]) == ("hang", 1, "n2",
                                                                                    "checkpoint save")
    lost = faults.classify(137, beats, [silent], faults.first_failed_task(SRUN), SRUN, ["n2"])
    assert (lost["kind"], lost["ranks"]) == ("node_lost", [1])
