"""Every rank's watchdog: a thread that ends a rank making no progress, after writing where every thread was.

The loop marks its progress (``mark(phase, step)``: two attribute stores, no I/O, no collective). The watchdog thread
wakes every second; when the current phase has lasted longer than its timeout (``fault.hang_timeout_s`` during steps,
``fault.startup_timeout_s`` until the first step has ended, ``fault.long_phase_timeout_s`` for checkpoints, resume,
evaluation and an epoch's first batch) it writes every thread's Python stack (faulthandler, which works from a
thread), under NCCL with its flight recorder on the collectives this rank entered, and a report naming the rank
that stopped first, then ends the process with ``EXIT_HANG``: srun (``--kill-on-bad-exit``) or torchrun end the
others, and the Slurm launcher restarts the run from its newest checkpoint.

Rank 0's thread renews the run folder's lease (runfolder.py) with its heartbeat. Each rank's thread also publishes
its progress every ``fault.heartbeat_s`` in ``run_dir/heartbeat/rank_<r>.json``
(step, phase, since when, what its GPU has finished (``DeviceProgress``), and ``alive``: when the thread last wrote),
where the others read it without a collective. A rank whose file stopped being written (a stopped or dead process)
stopped first; else the one that is not waiting in a collective (a loader that never delivers); else, every host
waiting in the same place, the one whose GPU finished least (a kernel that never ends); the others were only waiting
for it. Rank 0
also reads the others' files each period once the first step has ended: a rank whose file is older than the step
timeout is stopped, dead or cut off whatever its phase (a slow checkpoint keeps its file fresh), and rank 0's watchdog
fires for it then, instead of waiting for a long phase's timeout.

A rank whose watchdog fires, or whose collective fails (the process group's timeout, a peer that closed), first asks
every rank of its launch for their stacks (``hangs/dump_request.json``, which each watchdog thread looks for every
tick): the rank that hung is often ended by the launcher, once the waiting rank's collective has timed out, long
before its own watchdog would fire, and its stacks say where it was (``hangs/rank_<r>.stacks.txt``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ..faults import COMPUTE, DATA, LOG, REDUCE, progress_key, where
from ..files import write_json_atomic
from ..runfolder import HANGS, HEARTBEAT, renew_lease
from .signals import EXIT_HANG

__all__ = ["COMPUTE", "DATA", "LOG", "REDUCE", "DeviceProgress", "Watchdog", "who_stopped"]
STARTUP = "start-up"
EPOCH_START, SAVE, RESUME, EVAL = "data (epoch start)", "checkpoint save", "resume", "evaluation"
LONG_PHASES = frozenset({EPOCH_START, SAVE, RESUME, EVAL})
"""Phases of the long timeout: work that is legitimately slow (files, a whole evaluation, a loader's warm-up)."""
STALE_BEATS = 3
"""A rank whose heartbeat is older than this many periods is not responding (stopped, or dead)."""
DUMP_REQUEST = "dump_request.json"
"""In ``hangs/``: a rank asks every rank of its launch to write its stacks now (the module says why)."""


def node_name() -> str:
    """The Slurm node this rank runs on (SLURMD_NODENAME: several "nodes" may share a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def launch_id() -> str:
    """One start of the ranks (a Slurm step, a torchrun restart): heartbeats of another start are not compared."""
    env = os.environ
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('MASTER_PORT')}-{env.get('TORCHELASTIC_RESTART_COUNT')}"
    return f"local-{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}-{os.getppid()}"


@dataclass
class Timeouts:
    """Seconds a phase may last without progress (``FaultConfig``'s)."""

    step: float
    startup: float
    long: float

    def of(self, phase: str, started: bool) -> float:
        if not started:
            return max(self.startup, self.long if phase in LONG_PHASES else 0)
        return self.long if phase in LONG_PHASES else self.step


WATCHDOG_FIRST_S = 60.0
"""How much longer than the watchdog's limit the process group waits in a long phase: the watchdog wakes every
second, then asks every rank for its stacks and reads the heartbeats before it ends the rank it names."""


def long_collective_timeout_s(parallel, fault) -> float:
    """The process group's timeout during start-up and the long phases (checkpoints, evaluation): ``parallel.timeout_s``
    or, with the watchdog on, past its start-up and long-phase limits. One clock decides: with NCCL's 600 s under a
    1,800 s long-phase limit, a rank slow in a save for more than 600 s got a waiting rank aborted by NCCL, recorded as
    that rank's crash without stacks; now the watchdog fires first and its report names the slow rank."""
    if not fault.enabled:
        return float(parallel.timeout_s)
    return max(float(parallel.timeout_s), max(fault.startup_timeout_s, fault.long_phase_timeout_s) + WATCHDOG_FIRST_S)


class DeviceProgress:
    """What this rank's device has finished, for its heartbeat. The step's host waits in its one reduction read on
    every rank alike, so the host's phase cannot tell a GPU that stopped from the GPUs waiting for it in a collective:
    an event recorded where the step's work is issued (after each micro-batch's forward, before its backward and the
    collectives; after the update) completes when the device has done everything before it. The watchdog thread asks
    each pending event whether it has completed (``query``: never a wait) and publishes the last that has; the rank
    whose device finished least is the one that stopped. On the CPU the step is synchronous: what is issued is done.

    ``new_event``: makes an object with ``record()`` and ``query()`` (``torch.cuda.Event``; a test's stand-in)."""

    TRIM = 64
    """Pending events the step's thread lets pile up before it drops the completed ones itself (between heartbeats)."""

    def __init__(self, new_event=None, device: torch.device | None = None):
        self.new_event, self.device = new_event, device
        self.pending: deque = deque()
        self.done: dict | None = None
        self._lock = threading.Lock()
        self._thread_device = threading.local()

    @classmethod
    def on(cls, device: torch.device) -> "DeviceProgress":
        if device.type == "cuda" and torch.cuda.is_available():
            return cls(torch.cuda.Event, device)
        return cls()

    def record(self, step: int, order: int, what: str) -> None:
        """The device's work issued so far, up to ``what`` of ``step`` (``order``: its place within the step)."""
        mark = {"step": step, "order": order, "what": what}
        if self.new_event is None:
            self.done = mark
            return
        event = self.new_event()
        event.record()  # on the current stream, behind the work issued so far
        self.pending.append((mark, event))
        if len(self.pending) >= self.TRIM:
            self.poll()

    def poll(self) -> dict | None:
        """The last mark whose event has completed (completed ones leave the queue); never waits for the device. The
        watchdog's thread names the rank's GPU first, so that CUDA does not make a context on GPU 0 for it."""
        with self._lock:
            if self.device is not None and not getattr(self._thread_device, "set", False):
                torch.cuda.set_device(self.device)  # once per thread asking
                self._thread_device.set = True
            while self.pending and self.pending[0][1].query():
                self.done = self.pending.popleft()[0]
        return self.done


@dataclass
class Watchdog:
    """One rank's watchdog thread (the module says what it does). ``on_hang`` ends the process (``os._exit``); tests
    pass another."""

    out: Path
    rank: int
    world_size: int
    timeouts: Timeouts
    heartbeat_s: float
    on_hang: object = None
    backend: str = "gloo"
    enabled: bool = True
    """False: the phases are recorded (``mark``) but no thread watches them and no heartbeat is written."""
    nccl_trace_entries: int = 0
    """NCCL's flight recorder's size (``fault.nccl_trace_entries``): 0, off, and nothing to write with a report."""
    device: DeviceProgress | None = None
    """What the rank's device has finished (``track``), in each heartbeat; None: not tracked."""
    phase: str = STARTUP
    step: int = 0
    since: float = field(default_factory=time.time)
    started: bool = False
    """The first step has ended (the start-up timeout no longer applies)."""
    fired: dict | None = None
    frozen_s: float = 0.0
    """How long this process was stopped (its thread did not run), if it was."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _request_seen: float = 0.0
    _lease_renewed: float = 0.0

    def __post_init__(self):
        self.node, self.launch, self.pid, self.born = node_name(), launch_id(), os.getpid(), time.time()

    @classmethod
    def for_run(cls, fault, out: Path, rank: int, world_size: int, backend: str = "gloo") -> "Watchdog":
        t = Timeouts(fault.hang_timeout_s, fault.startup_timeout_s, fault.long_phase_timeout_s)
        return cls(Path(out), rank, world_size, t, fault.heartbeat_s, backend=backend, enabled=fault.enabled,
                   nccl_trace_entries=fault.nccl_trace_entries)

    def describe(self) -> str:
        t = self.timeouts
        return (f"watchdog: a rank making no progress is ended after {t.step:g} s in a step, {t.startup:g} s until the "
                f"first step has ended, {t.long:g} s in checkpoints, resume and evaluation (fault.*); heartbeats every "
                f"{self.heartbeat_s:g} s in {self.out / HEARTBEAT}")

    def mark(self, phase: str, step: int | None = None) -> None:
        """Progress: this rank entered ``phase`` now (of ``step``, if given). No I/O: the thread publishes it."""
        self.phase, self.since = phase, time.time()
        if step is not None:
            self.step = step

    def track(self, device: DeviceProgress) -> None:
        """Publish what the device has finished (``device_mark``) with each heartbeat, for ``who_stopped``."""
        self.device = device

    def device_mark(self, step: int, order: int, what: str) -> None:
        """The step's work issued up to here (``DeviceProgress.record``); nothing without the watchdog's thread."""
        if self.enabled and self.device is not None:
            self.device.record(step, order, what)

    def step_done(self, step: int) -> None:
        """A step ended: from the first one on, the start-up timeout no longer applies. Without the thread
        (fault.enabled false), rank 0 renews the run folder's lease here, once per heartbeat period."""
        self.started = True
        self.mark(DATA, step)
        if not self.enabled and self.rank == 0 and self.since - self._lease_renewed >= self.heartbeat_s:
            self._lease_renewed = self.since
            self._renew_lease()

    def _renew_lease(self) -> None:
        try:
            renew_lease(self.out)
        except OSError:
            pass  # as a heartbeat: a full or vanished file system must not end a rank that is training

    def start(self) -> "Watchdog":
        if not self.enabled:
            return self
        (self.out / HEARTBEAT).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="convit-scale-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, state: str = "ended") -> None:
        """End the thread; the last heartbeat says how the rank ended ("finished", "stopped", "failed: ...")."""
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.publish(state)

    def beat(self, state: str = "running") -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "node": self.node, "pid": self.pid,
                "launch": self.launch, "step": self.step, "phase": self.phase, "since": self.since,
                "alive": time.time(), "born": self.born, "started": self.started, "state": state,
                "device": None if self.device is None else self.device.poll()}

    def publish(self, state: str = "running") -> None:
        if not self.enabled:
            return
        try:
            write_json_atomic(self.out / HEARTBEAT / f"rank_{self.rank}.json", self.beat(state), fsync=False)
        except OSError:
            pass  # a full or vanished file system must not end a rank that is training
        if self.rank == 0 and state == "running":  # the run folder's lease, renewed with rank 0's heartbeat
            self._renew_lease()

    @property
    def tick(self) -> float:
        """How often the thread wakes (and answers a request for stacks)."""
        return min(1.0, self.heartbeat_s / 2)

    def _run(self) -> None:
        last = woke = time.time()
        while not self._stop.wait(self.tick):
            now = time.time()
            if now - woke > STALE_BEATS * self.heartbeat_s:  # this thread did not run: the whole process was stopped
                self.frozen_s = now - woke
            woke = now
            if now - last >= self.heartbeat_s:
                self.publish()
                last = now
                peer = self._silent_peer(now)
                if peer is not None:
                    self.fire(now - peer["alive"], self.timeouts.step, peer)
                    return
            self._answer_request()
            limit = self.timeouts.of(self.phase, self.started)
            if now - self.since > limit:
                self.fire(now - self.since, limit)
                return

    def _silent_peer(self, now: float) -> dict | None:
        """Rank 0 (once the first step has ended) reads the other ranks' heartbeats: one that has not written its
        heartbeat for the step timeout is stopped, dead or cut off, in whatever phase it was. A heartbeat is written
        by its rank's own thread whatever the rank's main thread is doing, so a slow checkpoint or evaluation keeps it
        fresh; without this, a rank stopped in a long phase was found only by the others' collective timeout
        (``parallel.timeout_s``) or their long-phase limit, minutes later, and the rank that failed first was one of
        the waiting ranks. One reader keeps the load on a shared file system at one file per rank per period."""
        if self.rank != 0 or not self.started or self.frozen_s:
            return None
        silent = [b for b in read_beats(self.out / HEARTBEAT, self.launch)
                  if b["rank"] != self.rank and b.get("state") == "running" and b.get("started")
                  and now - b["alive"] > self.timeouts.step]
        return min(silent, key=lambda b: b["alive"]) if silent else None

    def request_stacks(self, reason: str) -> None:
        """Ask every rank of this launch to write its stacks now (their watchdog threads answer within a tick)."""
        if not self.enabled:
            return
        try:
            (self.out / HANGS).mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.out / HANGS / DUMP_REQUEST, {"rank": self.rank, "node": self.node,
                              "launch": self.launch, "reason": reason, "time": time.time()}, fsync=False)
        except OSError:
            pass  # the report that follows still has this rank's own stacks

    def _answer_request(self) -> None:
        """Write this rank's stacks when another rank of this launch asked for them (``request_stacks``)."""
        path = self.out / HANGS / DUMP_REQUEST
        try:
            mtime = path.stat().st_mtime
            if mtime <= self._request_seen:
                return
            self._request_seen = mtime
            req = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if req.get("launch") != self.launch or req.get("rank") == self.rank or req.get("time", 0) < self.born:
            return
        stacks = self.write_stacks(f"asked by rank {req.get('rank')} on {req.get('node')} ({req.get('reason')}); "
                                   f"this rank had been in {where(self.step, self.phase)} for "
                                   f"{time.time() - self.since:.0f} s", child_states())
        if self._traced:  # the collectives this rank entered: beside the asking rank's, who waited on whom
            dump_flight_recorder(self.out / HANGS / f"rank_{self.rank}.nccl_trace.pkl")
        print(f"[convit-scale] rank {self.rank} on {self.node}: every thread's stack in {stacks} (asked by rank "
              f"{req.get('rank')}: {req.get('reason')})", file=sys.stderr, flush=True)

    @property
    def _traced(self) -> bool:
        """NCCL's flight recorder holds this rank's collectives (the backend is NCCL and the recorder is on)."""
        return self.backend == "nccl" and self.nccl_trace_entries > 0

    def write_stacks(self, headline: str, children: list[dict] | None = None) -> Path:
        """Every thread's Python stack (faulthandler: works from this thread, whatever the main thread is doing),
        then this rank's child processes (its loader workers) with their state and wait channel."""
        hangs = self.out / HANGS
        hangs.mkdir(parents=True, exist_ok=True)
        stacks = hangs / f"rank_{self.rank}.stacks.txt"
        with open(stacks, "w") as f:
            f.write(f"rank {self.rank} on {self.node}, pid {self.pid}: {headline}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            if children is not None:
                f.write(f"\nchild processes (loader workers) of pid {self.pid}: "
                        + ("; ".join(f"pid {c['pid']} {c['name']} state {c['state']} waiting in {c['wchan'] or '-'}"
                                     for c in children) or "none") + "\n")
        return stacks

    def fire(self, waited: float, limit: float, peer: dict | None = None) -> dict:
        """Stacks (this rank's, and every other rank's asked for), flight recorder, report, then ``on_hang``
        (default: end the process with ``EXIT_HANG``). ``peer``: the heartbeat of another rank that stopped writing
        it (``_silent_peer``), the one this report is about."""
        hangs = self.out / HANGS
        what = (f"no heartbeat from {_where(peer)} for {waited:.0f} s (in {where(peer['step'], peer['phase'])})"
                if peer else f"no progress for {waited:.0f} s in {where(self.step, self.phase)}")
        self.request_stacks(f"its watchdog fired: {what}")
        children = child_states()  # now: once a rank ends, the job's kill continues (SIGCONT) stopped workers
        stacks = self.write_stacks(f"{what} (limit {limit:g} s)", children)
        print(f"[convit-scale] rank {self.rank} on {self.node}: {what}; every thread's stack (also in {stacks}):\n"
              f"{stacks.read_text()}", file=sys.stderr, flush=True)
        trace = dump_flight_recorder(hangs / f"rank_{self.rank}.nccl_trace.pkl") if self._traced else None
        self.publish("hung")
        time.sleep(min(2.0, self.heartbeat_s))  # the other ranks that fire now publish their state too
        if self.frozen_s:  # continued after a stop (the job's kill sends SIGCONT first): this rank is the one
            verdict = {"culprits": [{"rank": self.rank, "node": self.node, "step": self.step, "phase": self.phase}],
                       "waiting": [], "summary": f"rank {self.rank} on {self.node} was stopped for "
                       f"{self.frozen_s:.0f} s (its watchdog did not run) in {where(self.step, self.phase)}"}
        else:
            beats = read_beats(self.out / HEARTBEAT, self.launch)
            verdict = who_stopped(beats, self.world_size, time.time(), self.heartbeat_s)
        report = {"rank": self.rank, "node": self.node, "pid": self.pid, "step": self.step, "phase": self.phase,
                  "waited_s": round(waited, 1), "limit_s": limit, "time": time.time(), "since": self.since,
                  "stacks": str(stacks), "nccl_trace": trace, "children": children, **verdict}
        write_json_atomic(hangs / f"rank_{self.rank}.json", report, fsync=False)
        print(f"[convit-scale] hang: {verdict['summary']}", file=sys.stderr, flush=True)
        self.fired = report
        (self.on_hang or _exit_hang)(report)
        return report


def collective_failure(e: BaseException) -> bool:
    """A collective that failed on this rank (the process group's timeout, a peer that closed its connection, NCCL's
    watchdog): another rank is the likely cause, and its stacks say where it was."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "NCCL", "Gloo"))


def _exit_hang(report: dict) -> None:
    """End the process; its DataLoader workers first: a stopped one would never see its parent go (torch's workers
    check every few seconds), and outlive the job where the cluster does not track processes (proctrack/linuxproc
    loses a reparented one)."""
    for child in report.get("children", []):
        try:
            os.kill(child["pid"], signal.SIGKILL)
        except OSError:
            pass
    sys.stderr.flush()
    os._exit(EXIT_HANG)


def dump_flight_recorder(path: Path) -> str | None:
    """NCCL's flight recorder (the collectives this rank entered, with ``fault.nccl_trace_entries`` above 0: train/
    distributed.py's ``set_flight_recorder``) into ``path``, where this torch exposes it; None otherwise."""
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        path.write_bytes(dump(True, True, False))
    except Exception as e:  # noqa: BLE001 -- a missing recorder must not stop the report that follows
        return f"not written: {type(e).__name__}: {e}"
    return str(path)


def child_states(pid: int | None = None) -> list[dict]:
    """This process's (or ``pid``'s) children (DataLoader workers), their state and where the kernel has them wait
    (``wchan``): a stopped (T) or uninterruptible (D) worker is where a rank waiting for data is stuck; a sleeping
    one waiting in a futex waits on a lock (a worker is forked from a process with other threads: a lock one of them
    held at the fork stays held in the worker), where an idle one waits on its queue's pipe."""
    found = []
    for task in Path(f"/proc/{pid or os.getpid()}/task").glob("*/children"):
        try:
            pids = task.read_text().split()
        except OSError:
            continue
        for kid in pids:
            try:
                stat = Path(f"/proc/{kid}/stat").read_text()
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            try:
                wchan = Path(f"/proc/{kid}/wchan").read_text().strip()
            except OSError:
                wchan = ""
            found.append({"pid": int(kid), "name": name, "state": state, "wchan": wchan})
    return found


def read_beats(folder: Path, launch: str | None = None) -> list[dict]:
    """The ranks' heartbeats in ``folder`` (of one launch, if given), by rank."""
    beats = []
    for f in folder.glob("rank_*.json"):
        try:
            b = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if launch is None or b.get("launch") == launch:
            beats.append(b)
    return sorted(beats, key=lambda b: b["rank"])


def _where(b: dict) -> str:
    return f"rank {b['rank']} on {b['node']}"


def _device_key(b: dict) -> tuple[int, int] | None:
    d = b.get("device")
    return None if d is None else (d["step"], d["order"])


def _device_text(b: dict) -> str:
    d = b.get("device")
    return "nothing" if d is None else f"the {d['what']} of step {d['step']}"


def _device_behind(beats: list[dict]) -> list[dict]:
    """The ranks whose device finished least (``DeviceProgress``), when every rank's is known and they differ."""
    keys = [_device_key(b) for b in beats]
    if None in keys or len(set(keys)) < 2:
        return []
    least = min(keys)
    return sorted((b for b, k in zip(beats, keys) if k == least), key=lambda b: b["since"])


def who_stopped(beats: list[dict], world_size: int, now: float, heartbeat_s: float) -> dict:
    """Which ranks stopped first and which were only waiting for them, from the heartbeats of one launch:

    1. ranks with no heartbeat, or whose heartbeat is older than ``STALE_BEATS`` periods (the process is stopped
       or dead);
    2. else the ranks furthest behind (``faults.progress_key``: the step, then the phase within it: data, then
       forward/backward, then the reduction) while others went further and wait for them in a collective;
    3. else, all at the same point (every host waits in the step's reduction, say), the ranks whose device finished
       least (``DeviceProgress``: a GPU that stopped, while the others' wait for it in a collective);
    4. else the one there longest.

    Returns culprits and waiting ranks (rank, node, step, phase, since, device), and a one-line summary."""
    seen = {b["rank"] for b in beats}
    missing = [r for r in range(world_size) if r not in seen]
    stale = [b for b in beats if now - b["alive"] > STALE_BEATS * heartbeat_s and b.get("state") != "hung"]
    if stale or missing:
        culprits, why = sorted(stale, key=lambda b: b["alive"]), "stopped responding (no heartbeat for {age:.0f} s)"
    elif beats:
        behind = min(progress_key(b["step"], b["phase"]) for b in beats)
        late = [b for b in beats if progress_key(b["step"], b["phase"]) == behind]
        if len(late) < len(beats):  # the others went further and wait for these (in a collective)
            culprits, why = sorted(late, key=lambda b: b["since"]), "made no progress for {age:.0f} s"
        elif device_late := _device_behind(beats):  # the same point, but these devices finished less
            culprits, why = device_late, ("stopped on its device after {device} (the others' devices went "
                                          "further; its host waited {age:.0f} s)")
        else:  # all at the same point: the one there longest
            culprits, why = [min(beats, key=lambda b: b["since"])], "was the first to stop ({age:.0f} s ago)"
    else:
        culprits, why = [], ""
    names = {b["rank"] for b in culprits}
    waiting = [b for b in beats if b["rank"] not in names]
    keep = ("rank", "node", "step", "phase", "since", "alive", "pid", "device")
    parts = [f"{_where(b)} " + why.format(age=now - (b["alive"] if b in stale else b["since"]), device=_device_text(b))
             + f" in {where(b['step'], b['phase'])}" for b in culprits]
    parts += [f"rank {r} never published a heartbeat" for r in missing]
    wait = (f"; ranks {', '.join(str(b['rank']) for b in waiting)} were waiting for it "
            f"({', '.join(sorted({b['phase'] for b in waiting}))})" if waiting else "")
    return {"culprits": [{k: b.get(k) for k in keep} for b in culprits] + [{"rank": r, "node": None} for r in missing],
            "waiting": [{k: b.get(k) for k in keep} for b in waiting],
            "summary": ("; ".join(parts) or "no heartbeat found") + wait}
