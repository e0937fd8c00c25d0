"""The rehearsal: a Table 1 Slurm script's multi-node job at its real rank count, end to end, on this machine.

    python -m convit_scale.rehearsal [--script slurm/convit_b_plus.sh] [--out runs/rehearsal] [overrides ...]
    python -m convit_scale.rehearsal --fault all|kill|stop|worker|node   (unplanned failures: rehearsal/faults.py)

starts the local Slurm cluster (cluster.py) with the script's nodes, each declaring as many CPUs and count-only GPUs
as the script has tasks per node (4 x 8 for convit_b_plus.sh), and submits the script itself: its #SBATCH shape,
``slurm/launch.sh``, one interpreter per rank (srun). Only the CPUs per task (1) and the recipe change: a tiny
ConViT on Fashion-MNIST WebDataset shards from ``data_prep``, ``data.num_workers: 0``, and the parallel layout of
the script's own recipe (by default FSDP2 as HSDP with one replica per node, shaped at each start; overrides after
the options change it), and the recipe's own global batch and canonical groups (ConViT-B+: 512 in 32 groups; on 24
ranks after the requeue, unequal shares: 8 ranks x 2 groups, 16 x 1). It submits the job with a node range
(``--nodes=R-N``, R = ``--requeue-nodes``, by default one node fewer than the script's N), lets it train on all N
nodes, sends the pre-timeout signal the script asks for (``--signal=USR1@300``) and drains one node, so that the
requeued job comes back on R nodes, as on a cluster where a node failed its health check. It checks that every rank
saved the same step, that the job requeued, resumed on R x tasks-per-node ranks ("resumed step S from W1 ranks on W2
ranks") and finished, and that its per-step losses equal those of the same script's job run without interruption on
N nodes: exactly up to the stop, within 1e-5 (relative) after it when the world size changed (another reduction
order). It prints the goodput figures (signal to checkpoint published, requeue to the first new step, steps lost)
and writes them with every check, the ranks' node mapping and the memory to ``OUT/rehearsal.json``. Exit status: 0
all checks passed, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import slurm_scripts
from ..errors import BadInput
from ..runfolder import EXIT_BAD_INPUT, META, METRICS, checkpoints, complete_checkpoints

REPO = Path(__file__).resolve().parents[2]
VAL_PER_CLASS = 20  # 200 images: not a multiple of 32 or 24 ranks, so the evaluation pads
STEPS_PER_EPOCH = 4
"""Steps an epoch of the rehearsal's training data (``train_per_class``): a checkpoint every epoch."""


def train_per_class(global_batch: int) -> int:
    """Fashion-MNIST training images per class for STEPS_PER_EPOCH global batches an epoch (and a few over)."""
    return max(50, math.ceil(STEPS_PER_EPOCH * global_batch / 10) + 5)
POLL_S = 0.2


class Refused(Exception):
    """Bad input: one line, exit 2."""


@dataclass
class JobShape:
    """What the Slurm script asks for (its #SBATCH lines) and the recipe it runs."""

    script: Path
    recipe: str
    nodes: int
    tasks_per_node: int
    signal: str  # e.g. "USR1@300"

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node


def read_script(script: Path) -> JobShape:
    """The job shape of a slurm/*.sh wrapper: --nodes, --ntasks-per-node, --signal and its RECIPE default."""
    if not script.is_file():
        raise Refused(f"--script {script}: no such file; allowed: one of slurm/*.sh")
    found = slurm_scripts.read_script(script)
    missing = [k for k in ("nodes", "ntasks-per-node", "signal") if not found.options.get(k)]
    missing += [] if found.recipe else ["RECIPE"]
    if missing:
        raise Refused(f"--script {script}: no {', '.join(missing)} in it; allowed: a slurm/*.sh wrapper of launch.sh "
                      f"with #SBATCH --nodes, --ntasks-per-node and --signal")
    return JobShape(script, found.recipe, found.nodes, found.tasks_per_node, found.options["signal"])


def prepare_data(root: Path, global_batch: int) -> Path:
    """Fashion-MNIST as WebDataset shards for STEPS_PER_EPOCH steps of ``global_batch`` an epoch, written once by
    data_prep (as the tests' fm_wds, resumable)."""
    from data_prep import PrepOptions, prepare
    from data_prep.fashion_mnist import build_tree

    per_class = train_per_class(global_batch)
    root = root / f"fashion_mnist_{per_class}_{VAL_PER_CLASS}"
    tree = build_tree(root / "tree", {"train": per_class, "val": VAL_PER_CLASS})
    out = root / "wds"
    if not (out / "manifest.json").is_file():
        prepare(tree, out, PrepOptions(fmt="wds", shard_size=96, workers=2))
    return out


def layout(shape: JobShape, overrides: list[str]) -> dict:
    """The parallel section the job trains with: the script's recipe's, with CPU-only settings (no compile, gloo,
    a timeout that fails a hang in minutes) and the overrides applied (validated with the recipe later). FSDP2
    without HSDP in the recipe gets HSDP with one replica per node at each start (sharded inside a node, replicated
    across nodes: the multi-node layout, kept inside nodes after a requeue onto fewer), unless an override sets
    parallel.hsdp_replicas or parallel.hsdp_per_node."""
    import yaml

    from convit_scale.config import find_recipe, load_config

    recipe = load_config(find_recipe(shape.recipe), [])
    p = {**recipe.to_dict()["parallel"], "compile": False, "backend": "auto", "timeout_s": 180}
    for item in overrides:
        key, _, value = item.partition("=")
        if not key.startswith("parallel.") or not value:
            raise Refused(f"override {item!r}: allowed: parallel.KEY=VALUE (the layout; the rest is the rehearsal's)")
        p[key[len("parallel."):]] = yaml.safe_load(value)
    hsdp = any(o.startswith(("parallel.hsdp_replicas=", "parallel.hsdp_per_node=")) for o in overrides)
    if p["strategy"] == "fsdp2" and p["hsdp_replicas"] == 1 and not hsdp:
        p["hsdp_per_node"] = True
    return p


def saves_beside_training(shape: JobShape) -> bool:
    """Whether the rehearsal's checkpoints are written beside training: as the script's recipe writes them
    (``checkpoint.async_save``)."""
    from convit_scale.config import find_recipe, load_config

    return load_config(find_recipe(shape.recipe), []).checkpoint.async_save


def recipe_batch(shape: JobShape) -> tuple[int, int]:
    """(global batch, canonical groups) of the script's own recipe: the rehearsal trains with them (any world size up
    to the groups, with unequal shares where the ranks do not divide them)."""
    from convit_scale.config import find_recipe, load_config

    d = load_config(find_recipe(shape.recipe), []).data
    if shape.world > d.groups:
        raise Refused(f"--script {shape.script.name}: {shape.world} ranks exceed its recipe's {d.groups} canonical "
                      f"groups")
    return d.global_batch_size, d.groups


def write_recipe(path: Path, data: Path, out: Path, parallel: dict, steps: int, batch: tuple[int, int],
                 extra: dict | None = None, async_save: bool = False) -> Path:
    """The rehearsal's recipe: convit_nano on the Fashion-MNIST shards, with the script's recipe's ``batch`` (global
    batch, canonical groups; ``recipe_batch``): ConViT-B+'s 512 in 32 groups, 4 steps an epoch (``prepare_data``),
    on 32 ranks, then 24 after the requeue (8 ranks x 2 groups, 16 x 1). Every step logged, a checkpoint every
    epoch (written beside training with ``async_save``: ``saves_beside_training``), the script's recipe's parallel
    layout (``layout``)."""
    import yaml

    from convit_scale.config import load_config

    global_batch, groups = batch
    recipe = {
        "model": {"name": "convit_nano", "num_classes": 10, "drop_path_rate": 0.1},
        "data": {"format": "wds", "train_path": str(data), "val_path": str(data), "global_batch_size": global_batch,
                 "canonical_groups": groups, "eval_batch_size": 50, "num_workers": 0, "repeated_aug": 1},
        "schedule": {"epochs": 20, "warmup_epochs": 1, "max_steps": steps},
        "parallel": parallel,
        "checkpoint": {"every_epochs": 1, "keep_last": 4, "async_save": async_save},
        "log": {"every_steps": 1, "progress": False},
        "run": {"output_dir": str(out)},
    }
    for section, values in (extra or {}).items():  # the fault rehearsal's checkpoints, watchdog and workers
        recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    load_config(path, [])  # refuses a bad override now, with the key, not in 32 ranks' logs
    return path


@dataclass
class Watch:
    """One job seen from outside: its metrics.jsonl records with the time each appeared, its Slurm state, its
    rank processes (node mapping and memory). Polled every POLL_S (the file), every second (Slurm) and every
    2 s (the processes), so that the watch costs little of the 2 cores the ranks share."""

    slurm: object
    job: int
    out: Path
    recipe: Path
    records: list = field(default_factory=list)  # (time seen, record), every record ever seen (also truncated ones)
    lines: set = field(default_factory=set)
    events: dict = field(default_factory=dict)  # first time of: running, requeued, restarted, published, ...
    ranks: dict = field(default_factory=dict)  # pid -> (rank, local rank, node id, node name)
    mem: dict = field(default_factory=lambda: {"ranks_rss_mb_max": 0.0, "ranks_anon_mb_max": 0.0,
                                               "rank_rss_mb_max": 0.0, "machine_used_mb_max": 0.0})
    cpu_s: dict = field(default_factory=dict)  # pid -> CPU seconds (user + system) when last seen
    load_max: float = 0.0  # the machine's 1-minute load average, highest seen
    startup_cpu_s: float | None = None  # the ranks' CPU time from their start to the first logged step
    state: dict = field(default_factory=dict)
    _last: dict = field(default_factory=lambda: {"file": None, "slurm": 0.0, "procs": 0.0})

    def poll(self) -> None:
        now, path = time.time(), self.out / METRICS
        stat = path.stat() if path.is_file() else None
        if stat is not None and (stat.st_mtime_ns, stat.st_size) != self._last["file"]:
            self._last["file"] = (stat.st_mtime_ns, stat.st_size)
            for line in path.read_text().splitlines():
                if line.strip() and line not in self.lines:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line being written
                    self.lines.add(line)
                    self.records.append((now, rec))
                    if rec.get("kind") == "train" and "first_step" not in self.events:
                        self.events["first_step"] = now
                        self._sample_ranks()  # the ranks' CPU time up to here: their start-up
                        self.startup_cpu_s = sum(self.cpu_s.values())
        if now - self._last["slurm"] >= 1.0:
            self._last["slurm"] = now
            self.state = self.slurm.job(self.job)
            js, restarts = self.state.get("JobState"), int(self.state.get("Restarts", "0") or 0)
            if js == "RUNNING":
                self.events.setdefault("running" if restarts == 0 else "restarted", now)
            if restarts >= 1:
                self.events.setdefault("requeued", now)
        if now - self._last["procs"] >= 2.0:
            self._last["procs"] = now
            self._sample_ranks()

    def _sample_ranks(self) -> None:
        """The ranks' node mapping (their environment, as srun or torchrun set it) and memory (RSS; anonymous
        memory, which the ranks do not share: the shared libraries' pages count once in the machine's use)."""
        rss = anon = 0.0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if str(self.recipe).encode() not in cmd or b"convit_scale.train" not in cmd \
                        or b"torch.distributed.run" in cmd:  # torchrun itself is not a rank
                    continue
                if pid not in self.ranks:
                    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                               if b"=" in kv)
                    get = lambda *keys: next((env[k].decode() for k in keys if k in env), None)  # noqa: E731
                    self.ranks[pid] = (int(get(b"RANK", b"SLURM_PROCID")), int(get(b"LOCAL_RANK", b"SLURM_LOCALID")),
                                       int(get(b"SLURM_NODEID")), get(b"SLURMD_NODENAME"))
                status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
                ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]  # utime, stime
                self.cpu_s[pid] = sum(map(int, ticks)) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, TypeError):
                continue  # gone, or not started far enough
            kb = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon")}
            rss, anon = rss + kb["VmRSS"] / 1024, anon + kb["RssAnon"] / 1024
            self.mem["rank_rss_mb_max"] = max(self.mem["rank_rss_mb_max"], kb["VmRSS"] / 1024)
        meminfo = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
        used = (int(meminfo["MemTotal"].split()[0]) - int(meminfo["MemAvailable"].split()[0])) / 1024
        for key, value in (("ranks_rss_mb_max", rss), ("ranks_anon_mb_max", anon), ("machine_used_mb_max", used)):
            self.mem[key] = max(self.mem[key], value)
        self.load_max = max(self.load_max, os.getloadavg()[0])

    def train(self) -> list[tuple[float, dict]]:
        return [(t, r) for t, r in self.records if r.get("kind") == "train"]

    def wait(self, cond, what: str, timeout: float) -> float:
        """Poll until ``cond()``; returns the time it became true. A job that ends first, or the timeout, fails."""
        t0 = time.time()
        while True:
            self.poll()
            if cond():
                return time.time()
            if self.state.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") or (
                    self.state.get("JobState") == "COMPLETED" and what != "the end"):
                raise JobFailed(f"job {self.job} is {self.state.get('JobState')} while waiting for {what}")
            if time.time() - t0 > timeout:
                raise JobFailed(f"job {self.job}: no {what} after {timeout:.0f} s (state {self.state.get('JobState')})")
            time.sleep(POLL_S)


class JobFailed(RuntimeError):
    pass


def submit(slurm, shape: JobShape, recipe: Path, data: Path, out: Path, log: Path, launcher: str,
           min_nodes: int | None = None, extra_env: dict | None = None) -> int:
    """The script as an operator submits it; only --cpus-per-task differs (one CPU per rank here). ``min_nodes``:
    submitted with the node range --nodes=MIN-N (starts, and restarts after a requeue, on any count in it)."""
    nodes = [f"--nodes={min_nodes}-{shape.nodes}"] if min_nodes and min_nodes != shape.nodes else []
    env = {"RECIPE": str(recipe), "OUTPUT_DIR": str(out), "DATA_DIR": str(data), "LAUNCHER": launcher,
           "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1",  # every "node" is this host
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(extra_env or {})}
    return slurm.sbatch("--cpus-per-task=1", *nodes, f"--output={log}", str(shape.script), env=env, cwd=REPO)


def run_interrupted(slurm, shape: JobShape, recipe: Path, data: Path, out: Path, signal_at: int,
                    launcher: str, requeue_nodes: int) -> tuple[Watch, dict]:
    """The job (node range ``requeue_nodes``-N) with the pre-timeout signal sent once step ``signal_at`` is
    logged, and its last N - ``requeue_nodes`` nodes drained then, so that the requeue comes back on
    ``requeue_nodes``; returns the watch and the stop: the checkpoint's step, its files and meta as published, and
    the event times. The drained nodes are resumed once the job ends."""
    log = out.parent / f"{out.name}.out"
    watch = Watch(slurm, submit(slurm, shape, recipe, data, out, log, launcher, requeue_nodes), out, recipe)
    watch.events["submitted"] = time.time()
    watch.wait(lambda: any(r["step"] >= signal_at for _, r in watch.train()), f"step {signal_at}", 900)
    # What --signal=USR1@T sends: to every task of the job's steps; --signal=B:USR1@T: to the batch shell only.
    sig = shape.signal.split("@")[0]
    to_batch = ["--batch"] if sig.startswith("B:") else []
    slurm.run("scancel", *to_batch, f"--signal={sig.removeprefix('B:')}", str(watch.job))
    watch.events["signal"] = time.time()
    drained = slurm.nodes[requeue_nodes:]
    if drained:  # the job keeps them until it ends (DRAINING); its requeue cannot have them
        slurm.run("scontrol", "update", f"NodeName={','.join(drained)}", "State=DRAIN", "Reason=rehearsal")
    ckpt = {}

    def published() -> bool:
        for d in complete_checkpoints(checkpoints(out)):
            meta = d / META
            if meta.is_file() and json.loads(meta.read_text()).get("reason") == "signal":
                ckpt.update(path=d, meta=json.loads(meta.read_text()),
                            files=sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()))
                return True
        return False

    watch.events["published"] = watch.wait(published, "checkpoint from the signal", 300)
    watch.wait(lambda: "requeued" in watch.events, "requeue", 300)
    watch.wait(lambda: "restarted" in watch.events, "restart", 600)
    step = ckpt["meta"]["step"]
    watch.events["first_new_step"] = watch.wait(
        lambda: any(r["step"] > step and t >= watch.events["restarted"] for t, r in watch.train()), "a new step", 900)
    watch.wait(lambda: watch.state.get("JobState") == "COMPLETED", "the end", 900)
    watch.events["ended"] = time.time()
    if drained:
        slurm.run("scontrol", "update", f"NodeName={','.join(drained)}", "State=RESUME")
    return watch, {**ckpt, "log": log}


def run_uninterrupted(slurm, shape: JobShape, recipe: Path, data: Path, out: Path, launcher: str) -> Watch:
    log = out.parent / f"{out.name}.out"
    watch = Watch(slurm, submit(slurm, shape, recipe, data, out, log, launcher), out, recipe)
    watch.events["submitted"] = time.time()
    watch.wait(lambda: watch.state.get("JobState") == "COMPLETED", "the end", 900)
    watch.events["ended"] = time.time()
    return watch


# -- what the two jobs show ------------------------------------------------------------------------------------
def dcp_chunks(ckpt: Path) -> int:
    """Into how many pieces the checkpoint splits its largest parameter: the shard dimension of the mesh (FSDP2
    over W ranks: W; HSDP (R, S): S, each piece saved once for its R replicas; DDP: 1)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    params = [m for k, m in meta.items() if k.startswith("model.") and hasattr(m, "chunks")]
    largest = max(params, key=lambda m: m.size.numel())
    return len(largest.chunks)


def steps_and_losses(watch: Watch) -> dict[int, float]:
    from convit_scale.metrics import read_records

    return {r["step"]: r["loss"] for r in read_records(watch.out, "train")}


def figures(a: Watch, b: Watch, stop: dict) -> dict:
    """Goodput of the interrupted job ``a``, from the times the watch saw things happen (to within POLL_S); the
    step time is the uninterrupted job's (``b``) median."""
    ev, step = a.events, stop["meta"]["step"]
    before = [r["step"] for t, r in a.train() if t < ev["restarted"]]
    ticks = [t for t, _ in b.train()]
    step_s = statistics.median(y - x for x, y in zip(ticks, ticks[1:])) if len(ticks) > 2 else None
    down = ev["first_new_step"] - ev["signal"]
    return {
        "signal_to_checkpoint_published_s": round(ev["published"] - ev["signal"], 1),
        "checkpoint_to_requeue_s": round(ev["requeued"] - ev["published"], 1),
        "requeue_to_restart_s": round(ev["restarted"] - ev["requeued"], 1),
        "restart_to_first_new_step_s": round(ev["first_new_step"] - ev["restarted"], 1),
        "requeue_to_first_new_step_s": round(ev["first_new_step"] - ev["requeued"], 1),
        "signal_to_first_new_step_s": round(down, 1),
        "steps_lost": max(before) - step,
        "signal_after_step": max((r["step"] for t, r in a.train() if t <= ev["signal"]), default=0),
        "checkpoint_step": step,
        "step_s": None if step_s is None else round(step_s, 2),
        "downtime_in_steps": None if not step_s else round(down / step_s, 1),
        "submit_to_first_step_s": round(next(t for t, _ in a.train()) - ev["submitted"], 1),
    }


def rank_file(strategy: str, rank: int) -> str:
    """The file of a checkpoint that only ``rank`` writes: its DCP shard, or its ZeRO partition."""
    return (f"zero/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" if strategy.startswith("zero")
            else f"dcp/__{rank}_0.distcp")


ELASTIC_RTOL = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}
"""Per-step losses after a requeue onto another world size, by ``parallel.precision``: within this (relative) of the
uninterrupted job's (the same samples and draws; only the reductions' order differs, and in bf16 each partial sum is
rounded to 8 bits of mantissa: 1.3e-5 measured at 32 -> 24 ranks, where fp32 gives about 1e-7 in the tests)."""


def losses_differ(la: dict[int, float], lb: dict[int, float], stop_step: int, rtol: float | None) -> float | None:
    """The largest (relative) difference between two jobs' per-step losses where it is not allowed: any up to the
    stop; after it, any (``rtol`` None: same world size) or beyond ``rtol`` (resumed on another world size). None:
    none, and both jobs logged the same steps."""
    if sorted(la) != sorted(lb):
        return math.inf
    worst = None
    for s in la:
        rel = abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12)
        allowed = rtol if rtol is not None and s > stop_step else 0.0
        if rel > allowed and (worst is None or rel > worst):
            worst = rel
    return worst


def checks(shape: JobShape, parallel: dict, a: Watch, b: Watch, stop: dict, steps: int,
           steps_lost: int, requeue_nodes: int | None = None) -> dict[str, str | None]:
    """Each check's failure, or None when it holds. ``requeue_nodes``: the nodes the interrupted job came back on
    (None: all of them)."""
    world, files, meta = shape.world, set(stop["files"]), stop["meta"]
    world2 = (requeue_nodes or shape.nodes) * shape.tasks_per_node
    stopped = [r["step"] for _, r in a.records if r.get("kind") == "stopped"]
    la, lb = steps_and_losses(a), steps_and_losses(b)
    after = [r["step"] for t, r in a.train() if t >= a.events["restarted"]]
    missing = [r for r in range(world) if {f"rng_rank{r}.pt", rank_file(parallel["strategy"], r)} - files]
    ranks = sorted(set(a.ranks.values()) | set(b.ranks.values()))
    want_ranks = sorted((n * shape.tasks_per_node + k, k, n, f"n{n + 1}") for n in range(shape.nodes)
                        for k in range(shape.tasks_per_node))
    evals = [r["samples"] for w in (a, b) for _, r in w.records if r.get("kind") == "eval"]
    widths = {len(r["peak_mem_mb"]) for w in (a, b) for t, r in w.train() if w is b or t < a.events["restarted"]}
    widths_after = {len(r["peak_mem_mb"]) for t, r in a.train() if t >= a.events["restarted"]}
    elastic = world2 != world
    rtol = ELASTIC_RTOL[parallel.get("precision", "fp32")] if elastic else None
    diff = losses_differ(la, lb, meta["step"], rtol)
    log = Path(stop["log"]).read_text(errors="replace") if stop.get("log") and Path(stop["log"]).is_file() else ""
    resumed = f"resumed step {meta['step']} from {world} rank(s) on {world2}"
    found = {
        "job requeued once and completed": None
        if (a.state.get("JobState"), a.state.get("Restarts")) == ("COMPLETED", "1")
        else f"state {a.state.get('JobState')}, restarts {a.state.get('Restarts')}",
        f"every rank saved step {meta['step']} (its own files from ranks 0-{world - 1})": None
        if not missing and meta.get("world_size") == world and stopped == [meta["step"]]
        else f"files missing from ranks {missing}, world size {meta.get('world_size')}, stopped at steps {stopped}",
        "resumed at the next step, nothing lost or repeated": None
        if after[:1] == [meta["step"] + 1] and sorted(la) == list(range(1, steps + 1)) and steps_lost == 0
        else f"first step after the restart {after[:1]}, steps {sorted(la)}, {steps_lost} lost",
        ("per-step losses equal the uninterrupted job's" if not elastic else
         f"per-step losses equal the uninterrupted job's up to the stop, within {rtol:g} after it"): None
        if diff is None and len(la) == steps else f"{len(la)} vs {len(lb)} steps, largest relative difference {diff}",
        "uninterrupted job completed without requeue": None
        if (b.state.get("JobState"), b.state.get("Restarts")) == ("COMPLETED", "0") else f"{b.state}",
        f"rank = node x {shape.tasks_per_node} + local rank on every node (srun block layout)": None
        if ranks == want_ranks else f"seen (rank, local rank, node id, node) {ranks}",
        f"all {world} ranks in every logged step" + (f" ({world2} after the requeue)" if elastic else ""): None
        if widths == {world} and widths_after == {world2}
        else f"ranks per step {widths}, after the requeue {widths_after}",
        f"requeued on {world2 // shape.tasks_per_node} nodes: \"{resumed}\" logged": None
        if resumed in log else f"no \"{resumed}\" in {stop.get('log')}",
        f"evaluation counted {10 * VAL_PER_CLASS} images once (padded to {world} ranks)": None
        if evals and set(evals) == {10 * VAL_PER_CLASS} else f"samples {evals}",
    }
    if parallel["strategy"] == "fsdp2":  # the mesh, as the checkpoint holds it (saved on all nodes)
        replicas = shape.nodes if parallel.get("hsdp_per_node") else parallel["hsdp_replicas"]
        pieces = world // replicas
        seen = dcp_chunks(stop["path"])
        found[f"parameters sharded {pieces} ways, each shard saved once (mesh {replicas} x {pieces})"] = \
            None if seen == pieces else f"{seen} pieces"
    return found


# -- the command -----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convit_scale.rehearsal", description=__doc__.split("\n\n")[0])
    p.add_argument("--script", default="slurm/convit_b_plus.sh", help="the Slurm script whose job shape runs")
    p.add_argument("--out", default="runs/rehearsal", help="data, both jobs' run folders and logs, rehearsal.json")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps of each job")
    p.add_argument("--signal-at", type=int, default=2, help="send the pre-timeout signal once this step is logged")
    p.add_argument("--launcher", default="srun", help="LAUNCHER of launch.sh: srun or torchrun")
    p.add_argument("--requeue-nodes", type=int, default=None,
                   help="the nodes the requeued job comes back on (default: one fewer than the script's; its node "
                        "count: the same nodes)")
    p.add_argument("overrides", nargs="*", help="parallel.KEY=VALUE: another layout than the recipe's")
    return p


def _refuse_bad_input(args, shape: JobShape) -> None:
    if not 1 <= args.signal_at < args.steps:
        raise Refused(f"--signal-at {args.signal_at}: allowed: 1 <= --signal-at < --steps ({args.steps})")
    if args.launcher not in ("srun", "torchrun"):
        raise Refused(f"--launcher {args.launcher}: allowed: srun or torchrun")
    if args.requeue_nodes is None:
        args.requeue_nodes = max(1, shape.nodes - 1)
    if not 1 <= args.requeue_nodes <= shape.nodes:
        raise Refused(f"--requeue-nodes {args.requeue_nodes}: allowed: 1 to the script's {shape.nodes} nodes")
    from .cluster import missing_requirements

    why = missing_requirements()
    if why:
        raise Refused(f"cannot start the local Slurm cluster: {why}")


def rehearse(args, shape: JobShape, parallel: dict) -> dict:
    """Both jobs on a fresh local cluster; the JSON report (raises JobFailed with the log's tail)."""
    import shutil

    from .cluster import LocalSlurm

    out = (REPO / args.out).resolve()
    t0, load_before = time.time(), round(os.getloadavg()[0], 1)
    batch = recipe_batch(shape)
    data = prepare_data(out / "data", batch[0])
    recipe = write_recipe(out / "recipe.yaml", data, out / "interrupted", parallel, args.steps, batch,
                          async_save=saves_beside_training(shape))
    for name in ("interrupted", "uninterrupted"):
        shutil.rmtree(out / name, ignore_errors=True)
        (out / f"{name}.out").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="rehearsal-slurm-") as root:
        slurm = LocalSlurm(Path(root), nodes=shape.nodes, cpus=shape.tasks_per_node, gpus=shape.tasks_per_node).start()
        try:
            a, stop = run_interrupted(slurm, shape, recipe, data, out / "interrupted", args.signal_at, args.launcher,
                                      args.requeue_nodes)
            b = run_uninterrupted(slurm, shape, recipe, data, out / "uninterrupted", args.launcher)
        except JobFailed as e:
            logs = sorted(out.glob("*.out"), key=lambda p: p.stat().st_mtime)
            raise JobFailed(f"{e}\n{logs[-1].read_text()[-4000:] if logs else 'no job log'}") from e
        finally:
            slurm.stop()
    fig = figures(a, b, stop)
    result = {"script": str(shape.script.relative_to(REPO)), "recipe_of_script": shape.recipe,
              "nodes": shape.nodes, "tasks_per_node": shape.tasks_per_node, "ranks": shape.world,
              "launcher": args.launcher, "parallel": parallel, "steps": args.steps, "signal": shape.signal,
              "requeue_nodes": args.requeue_nodes,
              "goodput": fig, "checks": checks(shape, parallel, a, b, stop, args.steps, fig["steps_lost"],
                                               args.requeue_nodes),
              "memory_mb": {k: round(max(a.mem[k], b.mem[k])) for k in a.mem},
              "ranks_cpu_s": {"interrupted": round(sum(a.cpu_s.values())),
                              "uninterrupted": round(sum(b.cpu_s.values())),
                              "start_to_first_step": round(b.startup_cpu_s or 0)},
              "timeline_s": {f"{job} {k}": round(t - t0, 1) for job, w in (("interrupted", a), ("uninterrupted", b))
                             for k, t in sorted(w.events.items(), key=lambda kv: kv[1])},
              "wall_s": round(time.time() - t0, 1),
              "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": load_before,
                          "load_avg_1min_max": round(max(a.load_max, b.load_max), 1)},
              "checkpoint": str(stop["path"]), "out": str(out),
              "ranks_seen": [dict(zip(("rank", "local_rank", "node_id", "node"), r))
                             for r in sorted(set(a.ranks.values()) | set(b.ranks.values()))]}
    (out / "rehearsal.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def report(result: dict) -> None:
    g, m = result["goodput"], result["memory_mb"]
    p = result["parallel"]
    print(f"rehearsal: {result['script']} as {result['nodes']} nodes x {result['tasks_per_node']} ranks, requeued "
          f"onto {result['requeue_nodes']} nodes ({result['launcher']}), {p['strategy']} {p['precision']} "
          f"{'hsdp per node' if p.get('hsdp_per_node') else 'hsdp_replicas ' + str(p['hsdp_replicas'])}, "
          f"{result['steps']} steps, {result['wall_s']:.0f} s")
    for name, failure in result["checks"].items():
        print(f"  {'ok  ' if failure is None else 'FAIL'} {name}" + ("" if failure is None else f": {failure}"))
    back = result["requeue_nodes"] * result["tasks_per_node"]  # the ranks the requeued job starts
    print(f"  goodput: signal -> checkpoint published {g['signal_to_checkpoint_published_s']} s; requeue -> first new "
          f"step {g['requeue_to_first_new_step_s']} s (Slurm's requeue {g['requeue_to_restart_s']} s, start-up and "
          f"resume of {back} ranks {g['restart_to_first_new_step_s']} s); signal -> first new step "
          f"{g['signal_to_first_new_step_s']} s; steps lost {g['steps_lost']}")
    print(f"  memory: {result['ranks']} ranks {m['ranks_rss_mb_max']} MB RSS ({m['ranks_anon_mb_max']} MB of it "
          f"anonymous, not shared), largest rank {m['rank_rss_mb_max']} MB; machine in use at most "
          f"{m['machine_used_mb_max']} MB")
    c, mach = result["ranks_cpu_s"], result["machine"]
    print(f"  CPU: the ranks used {c['interrupted']} s (interrupted job, 2 starts) and {c['uninterrupted']} s "
          f"(uninterrupted, {c['start_to_first_step']} s of it before the first step); {mach['cpus']} CPUs, load "
          f"average {mach['load_avg_1min_before']} before, {mach['load_avg_1min_max']} at most")
    print(f"  written to {result['out']}/rehearsal.json")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        shape = read_script((REPO / args.script).resolve())
        _refuse_bad_input(args, shape)
        parallel = layout(shape, args.overrides)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BadInput as e:  # a recipe or override refused by load_config
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        result = rehearse(args, shape, parallel)
    except JobFailed as e:
        print(f"rehearsal failed: {e}", file=sys.stderr)
        return 1
    report(result)
    return 0 if all(v is None for v in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
