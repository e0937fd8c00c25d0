"""What several test files use: the tests' tiny recipe, and the ways to run it (in this process, on N local ranks
started by torchrun, several runs in one launch, the `convit-scale` command). Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from convit_scale.metrics import read_records

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def tiny_recipe(path: Path, fmt: str, data_dir: Path, out: Path, **sections) -> Path:
    """A CPU recipe on the embedded data; ``sections`` override whole keys ({'parallel': {...}})."""
    import yaml

    recipe = {
        "model": {"name": "convit_nano", "num_classes": 10, "drop_path_rate": 0.1},
        "data": {"format": fmt, "train_path": str(data_dir), "val_path": str(data_dir), "global_batch_size": 32,
                 "eval_batch_size": 50, "num_workers": 0, "repeated_aug": 1},
        "schedule": {"epochs": 2, "warmup_epochs": 1},
        "parallel": {"strategy": "fsdp2", "precision": "fp32", "timeout_s": 60},
        "log": {"every_steps": 1, "progress": False},
        "run": {"output_dir": str(out)},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_group(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``, the command in a process group of its own: past
    ``timeout``, the whole group is killed (torchrun and its ranks, their loader workers), not only the command,
    whose ranks would live on beside the next tests, and the error ends with what the command had printed. The
    group is killed on any exception in the wait, not only the time limit: pytest-timeout's failure raised inside
    ``communicate`` would otherwise leave the wait (``Popen``'s exit waits for the command, for ever when its ranks
    hang) holding the test worker."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:  # the time limit, or pytest-timeout's failure, or Ctrl-C inside the wait
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes
            out, err = "", ""
            proc.kill()
            proc.wait(timeout=30)
        e.add_note(f"the end of its output:\n{(out or '')[-2000:]}\n{(err or '')[-4000:]}")
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return run_group([PY, "-m", "convit_scale.cli", *args], timeout, env=full_env)


def run_ranks(recipe: Path, *overrides: str, nproc: int = 2, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """The recipe on ``nproc`` local ranks started by torchrun: ``python -m convit_scale.train``, the entry point
    that torchrun, srun and accelerate launch (rank 0 runs the preflight). The same run as ``convit-scale train
    --nproc-per-node``, without that command's own process, whose start-up (importing torch and timm, ~7 s on
    2 cores) comes before the ranks'; the tests of the command itself (refusals before any process, signals,
    exit statuses) use ``run_cli``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return run_group(ranks_cmd(recipe, *overrides, nproc=nproc), timeout, env=full_env)


def train_here(recipe: Path, *overrides: str, env: dict | None = None) -> int:
    """The recipe on one rank in this process (a one-process gloo group), for what needs no second rank: no
    interpreter start-up. Returns the exit status ``python -m convit_scale.train`` would have; ``env`` is set for
    the run only (fault injection is read at set-up)."""
    from convit_scale.config import load_config
    from convit_scale.train.engine import exit_status

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return exit_status(load_config(recipe, list(overrides)))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_many(runs: list[dict], folder: Path, nproc: int = 2, timeout: int = 1200) -> list:
    """Several runs ({"recipe", "overrides", "env"}) one after another in one launch of ``nproc`` ranks
    (tests/rank_runs.py): the ranks start once for all of them. Returns each run's status, for its own test to
    assert: the exit status, "error: ..." for a run that raised, or, for the runs a launch that died never reached,
    "not run: ..." with the end of its output. The log lines are in ``folder/output.txt``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    plan = folder / "plan.json"
    plan.write_text(json.dumps([{"overrides": [], "env": {}, **r, "recipe": str(r["recipe"])} for r in runs]))
    statuses_file = folder / "statuses_rank0.json"
    statuses_file.unlink(missing_ok=True)
    res = run_group(torchrun_cmd(nproc, str(REPO / "tests" / "rank_runs.py"), str(plan)), timeout,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    (folder / "output.txt").write_text(res.stdout + res.stderr)  # the runs' log lines, one after another
    statuses = json.loads(statuses_file.read_text()) if statuses_file.is_file() else []
    why = f"not run: the launch ended with status {res.returncode}: {res.stderr[-1500:]}"
    return statuses + [why] * (len(runs) - len(statuses))


def torchrun_cmd(nproc: int, *program: str) -> list[str]:
    """torchrun on this machine (static rendezvous on a free port) running ``program`` (a script and its
    arguments, or ``-m module ...``): the one place the tests build a torchrun command line."""
    from convit_scale.train.distributed import free_port

    return [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *program]


def ranks_cmd(recipe: Path, *overrides: str, nproc: int = 2) -> list[str]:
    return torchrun_cmd(nproc, "-m", "convit_scale.train", "--recipe", str(recipe), *overrides)


def records(out: Path, kind: str = "train") -> list[dict]:
    return read_records(out, kind)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out)]


@contextlib.contextmanager
def one_rank_group(device, local_rank: int = 0):
    """A one-process group in this process for strategies built by a test (gloo on the CPU, NCCL on a GPU), as
    torchrun would start rank 0 of 1 with ``LOCAL_RANK=local_rank``; the environment is put back after it."""
    from convit_scale import comm
    from convit_scale.train.distributed import free_port, init_distributed

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(local_rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield init_distributed("nccl" if device.type == "cuda" else "gloo", 60)
    finally:
        comm.destroy()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def built_strategy(device, *overrides: str, micro_batch: int = 4):
    """convit_nano (10 classes) under the strategy of ``overrides`` (dotted recipe keys), set up on ``device`` for one
    rank of a group that exists (``one_rank_group``), with the recipe's AdamW."""
    import torch

    from convit_scale.config import load_config
    from convit_scale.models import create_model
    from convit_scale.parallel import build_strategy
    from convit_scale.train.optim import build_optimizer

    cfg = load_config(None, ["model.name=convit_nano", "model.num_classes=10", *overrides])
    torch.manual_seed(0)
    strategy = build_strategy(create_model("convit_nano", num_classes=10), cfg.parallel, device, 1,
                              cfg.optim.grad_clip)
    strategy.setup(lambda m: build_optimizer(m, cfg.optim, 1e-3, device), micro_batch, 1)
    return strategy


def strategy_step(strategy, device, batch: int = 4, seed: int = 0) -> None:
    """One training step of a ``built_strategy`` on a random batch of 16-pixel images."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 16, 16, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss = torch.nn.functional.cross_entropy(strategy.forward(x).float(), y)
    strategy.backward(loss, True, 1)
    strategy.grad_square_sum()
    strategy.step(None)


def universal_state_placement(device, folder: Path, *overrides: str) -> list[tuple]:
    """A ZeRO run of one step on ``device`` saved to ``folder``, loaded by a new strategy as a checkpoint of 2 ranks
    (``load(folder, 2)``: through DeepSpeed's universal checkpoint) and stepped once more. Returns, per optimizer state
    tensor, (key, its dtype, its device, the parameter's dtype, the parameter's device, whether the optimizer is fused
    or capturable), read right after the load."""
    strategy = built_strategy(device, *overrides)
    strategy_step(strategy, device)
    strategy.save(folder)
    strategy.close()
    strategy = built_strategy(device, *overrides)
    try:
        strategy.load(folder, 2)
        inner = getattr(strategy.optimizer, "optimizer", strategy.optimizer)
        fused = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
        placed = [(key, value.dtype, value.device, param.dtype, param.device, fused)  # by the state's keys: ZeRO-3
                  for param, state in inner.state.items()  # empties the groups' parameter lists between steps
                  for key, value in state.items() if hasattr(value, "device")]
        strategy_step(strategy, device, seed=1)  # the fused AdamW reads the loaded step
    finally:
        strategy.close()
    return placed


def encoded_image(color=(200, 30, 30), size=(40, 30), mode="RGB", fmt="JPEG") -> bytes:
    """A small image file's bytes: an RGB image of one colour, converted to ``mode`` and saved as ``fmt`` (the
    CMYK, greyscale and PNG-named-JPEG inputs ImageNet holds)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(buf, format=fmt)
    return buf.getvalue()


def epoch_batches(loader, epoch=0, start_batch=0) -> list:
    """(images, labels, bad samples) of each batch of a loader's epoch, copied out of the loader's buffers."""
    return [(b.images.clone(), b.labels.clone(), b.bad) for b in loader.epoch(epoch, start_batch)]


def ffcv_loader(path, workers: int, split: str = "train", repeats: int = 1):
    """The FFCV loader of a prepared folder at 32 pixels, micro-batches of 16, seed 3."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    d = DataConfig(format="ffcv", train_path=str(path), val_path=str(path), num_workers=workers, repeated_aug=repeats)
    return build_loader(d, LoaderSpec(split, 32, 16, seed=3))
