"""The watchdog: a rank that makes no progress is ended after its stacks are written, and the report names the rank
that stopped first (from the heartbeats, without a collective); the loop's phases and checkpoint.every_minutes."""

import json
import os
import subprocess
import threading
import time

from support import records, tiny_recipe, train_here

from convit_scale.config import FaultConfig
from convit_scale.train.watchdog import (
    COMPUTE,
    DATA,
    EVAL,
    REDUCE,
    SAVE,
    DeviceProgress,
    Timeouts,
    Watchdog,
    collective_failure,
    who_stopped,
)


def _beat(rank, step, phase, since, alive, node="n1", state="running"):
    return {"rank": rank, "node": node, "step": step, "phase": phase, "since": since, "alive": alive, "pid": 100 + rank,
            "state": state}


def _waiting_in_the_reduction(fired: threading.Event, limit: float) -> float:
    t0 = time.time()
    fired.wait(limit)
    return time.time() - t0


def test_a_rank_without_progress_is_ended_after_its_stacks_naming_the_rank_that_stopped(tmp_path, capsys):
    """Rank 0 waits in the step's reduction; rank 1's heartbeat stopped (a SIGSTOPped process): rank 0's watchdog
    fires within its timeout, writes every thread's stack (the waiting function is in it) and names rank 1."""
    fired, reports = threading.Event(), []
    wd = Watchdog(tmp_path, 0, 2, Timeouts(step=1.0, startup=1.0, long=5.0), heartbeat_s=0.2,
                  on_hang=lambda r: (reports.append(r), fired.set()))
    wd.start()
    wd.started = True
    wd.mark(REDUCE, 31)
    now = time.time()
    beat = {**_beat(1, 31, COMPUTE, now - 1, now - 30, node="n2"), "launch": wd.launch}
    (tmp_path / "heartbeat" / "rank_1.json").write_text(json.dumps(beat))
    waited = _waiting_in_the_reduction(fired, 20)
    assert reports and 1.0 < waited < 1.0 + 2.0 + 1.5, waited  # the timeout, the others' 2 s to publish, a tick
    report = reports[0]
    stacks = (tmp_path / "hangs" / "rank_0.stacks.txt").read_text()
    assert "_waiting_in_the_reduction" in stacks and "no progress for 1 s in step 32 (reduction)" in stacks
    assert [c["rank"] for c in report["culprits"]] == [1] and [w["rank"] for w in report["waiting"]] == [0]
    assert report["summary"].startswith("rank 1 on n2 stopped responding") and "in step 32 (forward/backward)" in \
        report["summary"] and "ranks 0 were waiting for it (reduction)" in report["summary"]
    assert json.loads((tmp_path / "hangs" / "rank_0.json").read_text())["culprits"][0]["node"] == "n2"
    err = capsys.readouterr().err
    assert "[convit-scale] hang: rank 1 on n2 stopped responding" in err and "_waiting_in_the_reduction" in err
    wd.stop()


def test_a_rank_whose_watchdog_fires_gets_the_stacks_of_every_other_rank(tmp_path, capsys):
    """The rank that hangs is often ended by the launcher (once the waiting rank's collective times out) long before
    its own watchdog fires: nobody could say where it was. Rank 0's watchdog fires; rank 1 (long timeouts, stuck in
    its evaluation) writes every thread's stack when asked, and goes on."""
    stuck = threading.Event()

    def _stuck_in_the_validation_loader():
        stuck.wait(60)

    threading.Thread(target=_stuck_in_the_validation_loader, daemon=True).start()
    worker = subprocess.Popen(["sleep", "60"])  # a loader worker of rank 1 (the ranks share this process here)
    slow = Timeouts(step=100, startup=100, long=100)
    r1 = Watchdog(tmp_path, 1, 2, slow, heartbeat_s=0.2, on_hang=lambda r: None).start()
    r1.started = True
    r1.mark(EVAL, 6)
    fired = threading.Event()
    r0 = Watchdog(tmp_path, 0, 2, Timeouts(step=1.0, startup=1.0, long=1.0), heartbeat_s=0.2,
                  on_hang=lambda r: fired.set()).start()
    r0.started = True
    r0.mark(REDUCE, 7)
    try:
        assert fired.wait(20)
        path = tmp_path / "hangs" / "rank_1.stacks.txt"
        t0 = time.time()
        while not path.is_file() and time.time() - t0 < 5:
            time.sleep(0.05)
        text = path.read_text()
        assert text.startswith("rank 1 on ") and "asked by rank 0 on " in text and "its watchdog fired" in text
        assert "this rank had been in evaluation after step 6 for " in text
        assert "_stuck_in_the_validation_loader" in text  # where it was
        assert f"pid {worker.pid} sleep state S waiting in " in text  # and its loader workers
        assert r1.fired is None and r1._thread.is_alive()  # asked, it only writes: its own timeouts still decide
        assert "rank 1 on " in capsys.readouterr().err
    finally:
        stuck.set()
        worker.kill()
        worker.wait()
        r1.stop()
        r0.stop()


def test_rank_0_fires_for_a_rank_whose_heartbeat_stopped_in_a_long_phase(tmp_path):
    """A rank stopped (SIGSTOP) during a checkpoint save: every rank sits in the long phase (limit 100 s here), where
    the waiting ranks' collectives time out only after parallel.timeout_s, and the first rank to fail was a waiting
    one (the 32-rank rehearsal recorded a crash of rank 1 after 195 s). Rank 0 reads the heartbeats: the stopped
    rank's file is older than the step timeout (1 s here), whatever its phase, and rank 0's watchdog fires naming
    it."""
    slow = Timeouts(step=1.0, startup=100, long=100)
    reports = []
    fired = threading.Event()
    r0 = Watchdog(tmp_path, 0, 2, slow, heartbeat_s=0.2, on_hang=lambda r: (reports.append(r), fired.set())).start()
    r1 = Watchdog(tmp_path, 1, 2, slow, heartbeat_s=0.2, on_hang=lambda r: None).start()
    for w in (r0, r1):
        w.step_done(4)
        w.mark(SAVE, 4)
    try:
        time.sleep(0.6)  # both heartbeats published while running
        assert not fired.is_set()
        r1._stop.set()  # rank 1 stopped: its thread writes no more heartbeats (and no last state)
        r1._thread.join(5)
        t0 = time.time()
        assert fired.wait(10)
        assert time.time() - t0 < 5  # the step timeout and a period, not the long phase's 100 s
        report = reports[0]
        assert [c["rank"] for c in report["culprits"]] == [1] and report["limit_s"] == 1.0
        assert "no heartbeat from rank 1 on " in (tmp_path / "hangs" / "rank_0.stacks.txt").read_text()
        assert "rank 1 on " in report["summary"] and "checkpoint save" in report["summary"]
    finally:
        r0.stop()


class _Event:
    """A CUDA event's stand-in: complete when recorded, unless its device is held (a GPU that stopped)."""

    def __init__(self, held: threading.Event):
        self.held = held

    def record(self):
        self.completes = not self.held.is_set()

    def query(self):
        return self.completes


def test_a_gpu_that_stopped_is_named_not_the_rank_that_waited_longest(tmp_path):
    """Every rank's host waits in the step's reduction read, whichever GPU stopped: rank 0 got there first (waited
    longest), rank 1's GPU stopped in its forward of step 32. The heartbeats say what each device finished (an event
    per mark, asked without waiting): rank 0's watchdog fires and names rank 1, and rank 0 as waiting."""
    held = [threading.Event(), threading.Event()]
    reports, fired = [], threading.Event()
    r0 = Watchdog(tmp_path, 0, 2, Timeouts(step=1.0, startup=1.0, long=1.0), heartbeat_s=0.2,
                  on_hang=lambda r: (reports.append(r), fired.set()))
    r1 = Watchdog(tmp_path, 1, 2, Timeouts(step=100, startup=100, long=100), heartbeat_s=0.2, on_hang=lambda r: None)
    for w, h in ((r0, held[0]), (r1, held[1])):
        w.track(DeviceProgress(lambda h=h: _Event(h)))
        w.start().step_done(31)
        w.device_mark(31, 1, "update")
    held[1].set()  # rank 1's GPU stops: what it is given from now on never completes
    for w in (r0, r1):
        w.mark(COMPUTE)
        w.device_mark(32, 0, "forward of micro-batch 1")
        w.mark(REDUCE)
        time.sleep(0.3)  # rank 0 entered the reduction first
    try:
        assert fired.wait(20)
        report = reports[0]
        assert [c["rank"] for c in report["culprits"]] == [1] and [w["rank"] for w in report["waiting"]] == [0]
        assert report["culprits"][0]["device"] == {"step": 31, "order": 1, "what": "update"}
        assert "rank 1 on " in report["summary"] and "stopped on its device after the update of step 31" in \
            report["summary"] and "in step 32 (reduction)" in report["summary"]
    finally:
        r1.stop()
        r0.stop()


def test_a_failed_collective_is_told_from_other_errors():
    import torch.distributed as dist

    from convit_scale.data import DataError

    assert collective_failure(dist.DistBackendError("[../gloo/transport/tcp/pair.cc:534] Connection closed"))
    assert collective_failure(RuntimeError("[../third_party/gloo/...] Timed out waiting 600000ms for recv"))
    assert collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    assert not collective_failure(ValueError("timed out"))
    assert not collective_failure(DataError("x: truncated shard"))
    assert not collective_failure(RuntimeError("CUDA out of memory"))


def test_who_stopped_first():
    now = 1000.0
    # every process alive: the rank not waiting in a collective (a loader that never delivers) is the culprit
    v = who_stopped([_beat(0, 5, REDUCE, now - 50, now), _beat(1, 5, DATA, now - 60, now)], 2, now, 1.0)
    assert [c["rank"] for c in v["culprits"]] == [1] and "never" not in v["summary"]
    assert v["summary"].startswith("rank 1 on n1 made no progress for 60 s in step 6 (data)")
    # all waiting: the one furthest behind; a rank with no heartbeat at all is named
    v = who_stopped([_beat(0, 7, REDUCE, now - 5, now), _beat(1, 6, REDUCE, now - 9, now)], 3, now, 1.0)
    assert "rank 2 never published a heartbeat" in v["summary"] and not v["waiting"] == []
    v = who_stopped([_beat(0, 7, REDUCE, now - 5, now), _beat(1, 6, EVAL, now - 9, now)], 2, now, 1.0)
    assert [c["rank"] for c in v["culprits"]] == [1] and "evaluation after step 6" in v["summary"]


def test_timeouts_by_phase():
    t = Timeouts(step=60, startup=900, long=1800)
    assert (t.of(DATA, started=True), t.of(EVAL, started=True), t.of(COMPUTE, started=False)) == (60, 1800, 900)
    assert FaultConfig().collective_timeout_s > FaultConfig().hang_timeout_s


def test_every_minutes_saves_after_the_same_step_on_every_rank_and_heartbeats_say_how_ranks_ended(fm_tree, tmp_path,
                                                                                                capsys):
    """checkpoint.every_minutes: rank 0's clock travels in the step's reduction (here every step is due); each save
    is timed in metrics.jsonl; the watchdog is announced, publishes heartbeats, and the last one says "finished".
    NCCL's flight recorder is off unless the recipe asks (recent torch turns it on by default), set before the group
    forms."""
    from convit_scale.train.distributed import FLIGHT_RECORDER_VARS, flight_recorder_var

    out = tmp_path / "out"
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                    schedule={"max_steps": 3}, checkpoint={"every_minutes": 1e-6, "keep_last": 5},
                    fault={"hang_timeout_s": 30, "heartbeat_s": 0.5, "collective_timeout_s": 60})
    assert train_here(r) == 0
    # exactly the name this torch reads: the other one makes torch >= 2.7 warn on every rank's console
    assert [os.environ.get(v) for v in FLIGHT_RECORDER_VARS] == (
        ["0", None] if flight_recorder_var() == FLIGHT_RECORDER_VARS[0] else [None, "0"])
    assert [flight_recorder_var(v) for v in ("2.6.0+cu124", "2.7.1", "2.14.1+cu130")] == [
        "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"]
    saves = records(out, "checkpoint")
    assert [(s["step"], s["reason"]) for s in saves] == [(1, "every_minutes"), (2, "every_minutes"), (3, "end")]
    assert all(s["save_s"] > 0 for s in saves)
    printed = capsys.readouterr().out
    assert "watchdog: a rank making no progress is ended after 30 s in a step" in printed
    assert "collective timeout 60 s from now on" in printed
    beat = json.loads((out / "heartbeat" / "rank_0.json").read_text())
    assert beat["state"] == "finished" and beat["step"] == 3 and beat["started"]
    assert beat["device"] == {"step": 3, "order": 1, "what": "update"}  # on the CPU, what is issued is finished


def test_child_states_say_where_the_kernel_has_each_worker_wait():
    """A hang report lists the rank's children with their state and wait channel: what tells a stopped worker (T),
    a worker stuck on a lock (S in a futex) and an idle one apart."""
    import signal
    import time

    from convit_scale.train.watchdog import child_states

    sleeper = subprocess.Popen(["sleep", "30"])
    stopped = subprocess.Popen(["sleep", "30"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        states = {c["pid"]: c for c in child_states()}
        assert states[sleeper.pid]["state"] == "S" and "sleep" in states[sleeper.pid]["wchan"]
        assert states[stopped.pid]["state"] in ("T", "t")
    finally:
        for p in (sleeper, stopped):
            p.kill()
            p.wait()


def test_the_watchdog_decides_before_the_process_group_in_long_phases():
    """With NCCL's 600 s under the watchdog's 1,800 s long-phase limit, a rank slow in a save for more than 600 s got
    a waiting rank aborted by NCCL (recorded as that rank's crash, without stacks). The process group's timeout of
    start-up and long phases is past the watchdog's limits, so the watchdog fires first and names the slow rank; with
    the watchdog off, parallel.timeout_s stands."""
    from convit_scale.config import load_config
    from convit_scale.train.watchdog import long_collective_timeout_s

    cfg = load_config(None, [])
    pg = long_collective_timeout_s(cfg.parallel, cfg.fault)
    assert pg > cfg.fault.long_phase_timeout_s and pg > cfg.fault.startup_timeout_s
    cfg = load_config(None, ["fault.long_phase_timeout_s=4000"])
    assert long_collective_timeout_s(cfg.parallel, cfg.fault) > 4000
    cfg = load_config(None, ["fault.enabled=false"])
    assert long_collective_timeout_s(cfg.parallel, cfg.fault) == cfg.parallel.timeout_s
