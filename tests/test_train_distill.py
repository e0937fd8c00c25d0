"""The Table 4 teacher (convit_scale/train/distill.py): hard distillation under FSDP2 and ZeRO-3 with 2 ranks, from
a small teacher trained here; bad teacher files refused before training; the teacher pinned by content (its SHA-256,
whatever the file is called) and by an accuracy band."""

import hashlib
import json
import types

import pytest
import torch
from support import losses, records, run_cli, run_many, tiny_recipe

from convit_scale.config import load_config
from convit_scale.errors import BadInput
from convit_scale.train import distill

TEACHER = "regnety_002"  # the RegNetY family of the paper's RegNetY-16GF, CPU-sized
_TEACHER_SHA: dict = {}


@pytest.fixture(scope="module")
def teacher_file(fm_tree, tmp_path_factory):
    """A RegNetY teacher trained on Fashion-MNIST with labels shifted by one class, saved to safetensors.

    The shift makes its influence measurable: a student that learns from it predicts y + 1 more often.
    """
    import timm
    from safetensors.torch import save_file

    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    torch.manual_seed(0)
    d = DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree), num_workers=0,
                   repeated_aug=1, rand_augment=None, reprob=0.0)
    loader = build_loader(d, LoaderSpec("train", 16, 64))  # the students (convit_nano) see 16x16
    teacher = timm.create_model(TEACHER, num_classes=10)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    for epoch in range(3):
        for x, y in loader.epoch(epoch):
            loss = torch.nn.functional.cross_entropy(teacher(x), (y + 1) % 10)
            opt.zero_grad()
            loss.backward()
            opt.step()
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, str(path))
    _TEACHER_SHA[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return path


def _recipe(tmp_path, name, fm_wds, teacher_file, strategy, distill=True, token=False, **sched):
    return tiny_recipe(
        tmp_path / f"{name}.yaml", "wds", fm_wds, tmp_path / name,
        model={"name": "deit_nano" if token else "convit_nano", "distill_token": token},
        data={"mixup": 0.0, "cutmix": 0.0, "rand_augment": None, "reprob": 0.0},
        optim={"base_lr": 2e-2}, schedule={"epochs": 2, "warmup_epochs": 0, **sched},
        parallel={"strategy": strategy}, checkpoint={"every_steps": 20}, log={"debug_digest": True},
        distill={"enabled": distill, "teacher_model": TEACHER, "teacher_checkpoint": str(teacher_file),
                 "type": "hard", "alpha": 0.5})


def _predictions(model, batches):
    with torch.no_grad():
        return torch.cat([model(x).argmax(1) for x, _ in batches])


SOFT = ["distill.type=soft", "distill.tau=1.0", "distill.alpha=1.0"]
"""DeiT's soft term averages over classes too (a tenth of a cross-entropy here): the teacher alone (after 4 epochs
the student agreed with the teacher on 80% of the images, the undistilled one on 2-5%)."""


@pytest.fixture(scope="module")
def distill_runs(fm_wds, teacher_file, tmp_path_factory):
    """Every distillation run of this file in one launch of 2 ranks (``support.run_many``), by (strategy, name).

    What depends on the strategy (the teacher outside the sharded model and its optimizer, the resumed state) is
    checked under FSDP2 and ZeRO-3; the loss's effect and the token variant, which do not, under FSDP2 only; under
    ZeRO-3 a shorter run: its checks need a teacher at work and a resume, not a trained student. "resumed" is the
    distilled run stopped part-way (``max_steps``) and resumed to a later step in the same folder, compared with the
    distilled run's steps so far (``max_steps`` ends a run early without changing its schedule); the token variant
    runs 20 steps (it is checked to train and evaluate, not to learn)."""
    tmp = tmp_path_factory.mktemp("distill")
    plan, folders = [], {}

    def add(strategy, name, overrides=(), **kw):
        r = _recipe(tmp, f"{strategy}_{name}", fm_wds, teacher_file, strategy, **kw)
        plan.append({"recipe": r, "overrides": list(overrides)})
        folders[strategy, name] = tmp / f"{strategy}_{name}"

    for name, kw in (("plain", {"distill": False}), ("distilled", {}), ("token", {"token": True, "max_steps": 20})):
        add("fsdp2", name, **kw)
    add("fsdp2", "resumed", max_steps=20)
    add("fsdp2", "resumed", ["schedule.max_steps=30"], max_steps=20)
    add("zero3", "distilled", max_steps=30)
    add("zero3", "resumed", max_steps=15)
    add("zero3", "resumed", ["schedule.max_steps=30"], max_steps=15)
    add("ddp", "soft", SOFT)  # against FSDP2's plain run: the strategy changes nothing that is compared
    assert run_many(plan, tmp / "plan") == [0] * len(plan)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_distillation_end_to_end(strategy, teacher_file, fm_wds, distill_runs):
    from convit_scale.trained import load_trained_model

    runs = {name: folder for (s, name), folder in distill_runs.items() if s == strategy}
    # the teacher never changed: not in memory, not on disk, never in the optimizer or the checkpoint
    for name in runs.keys() - {"plain"}:
        for rec in records(runs[name], "distill"):
            assert rec["teacher_checksum_start"] == rec["teacher_checksum_end"] and not rec["teacher_in_optimizer"]
    assert hashlib.sha256(teacher_file.read_bytes()).hexdigest() == _TEACHER_SHA[teacher_file]
    end = records(runs["distilled"], "end")[0]
    student = load_trained_model(end["checkpoint"])  # loads strictly: no teacher keys in the checkpoint
    if strategy == "fsdp2":
        _distilled_agrees_with_the_teacher_and_the_token_variant_trains(fm_wds, teacher_file, runs, student)
    # resume restores the distillation state: stopped part-way and resumed, the same losses, each step once
    assert len(records(runs["resumed"], "end")) == 2
    resumed = losses(runs["resumed"])
    assert len(resumed) == 30 and resumed == losses(runs["distilled"])[:30]


def _distilled_agrees_with_the_teacher_and_the_token_variant_trains(fm_wds, teacher_file, runs, student):
    import timm
    from safetensors.torch import load_file

    from convit_scale.analysis.report import eval_batches
    from convit_scale.trained import load_trained_model

    # the distilled student agrees with the teacher more than the undistilled one trained the same way
    batches = eval_batches(str(fm_wds), "wds", 16, 200)
    teacher = timm.create_model(TEACHER, num_classes=10)
    teacher.load_state_dict(load_file(str(teacher_file)))
    teacher.eval()
    t_pred = _predictions(teacher, batches)
    plain = load_trained_model(records(runs["plain"], "end")[0]["checkpoint"])
    agree_distilled = (_predictions(student, batches) == t_pred).float().mean().item()
    agree_plain = (_predictions(plain, batches) == t_pred).float().mean().item()
    assert agree_distilled > agree_plain + 0.1, (agree_distilled, agree_plain)
    # the distillation-token variant trains and evaluates (two heads averaged at eval)
    token_eval = records(runs["token"], "eval")
    assert token_eval and token_eval[-1]["samples"] == 200 and 0 <= token_eval[-1]["top1"] <= 100
    assert load_trained_model(records(runs["token"], "end")[0]["checkpoint"]).head_dist is not None


def test_bad_teacher_files_are_refused_before_training(fm_wds, teacher_file, tmp_path):
    from safetensors.torch import load_file, save_file

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(teacher_file.read_bytes()[:1000])
    mismatched = tmp_path / "mismatched.safetensors"
    sd = load_file(str(teacher_file))
    sd.pop("head.fc.weight")
    sd["extra.weight"] = torch.zeros(1)
    save_file(sd, str(mismatched))
    cases = [(tmp_path / "missing.pth", "checkpoint file not found"), (corrupt, "not a readable safetensors file"),
             (mismatched, "missing keys (1): head.fc.weight | unexpected keys (1): extra.weight")]
    for path, message in cases:
        r = _recipe(tmp_path, "bad", fm_wds, path, "fsdp2")
        res = run_cli("train", "--recipe", str(r), "--nproc-per-node", "2")
        assert res.returncode == 2 and message in res.stderr and str(path) in res.stderr, res.stderr[-2000:]
        assert not (tmp_path / "bad").exists()  # refused before any process started


def test_eval_command_measures_a_teacher(fm_wds, teacher_file):
    res = run_cli("eval", "--model", TEACHER, "--checkpoint", str(teacher_file), "--data", str(fm_wds),
                  "--num-classes", "10", "--img-size", "16")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{TEACHER}: top-1" in res.stdout and "(200 images on cpu, wds data, " in res.stdout


@pytest.mark.slow
def test_soft_distillation_trains_towards_the_teacher(fm_wds, teacher_file, distill_runs):
    import timm
    from safetensors.torch import load_file

    from convit_scale.analysis.report import eval_batches
    from convit_scale.trained import load_trained_model

    students = {name: load_trained_model(records(distill_runs[strategy, name], "end")[0]["checkpoint"])
                for strategy, name in (("fsdp2", "plain"), ("ddp", "soft"))}
    batches = eval_batches(str(fm_wds), "wds", 16, 200)
    teacher = timm.create_model(TEACHER, num_classes=10)
    teacher.load_state_dict(load_file(str(teacher_file)))
    t_pred = _predictions(teacher.eval(), batches)
    agree = {k: (_predictions(m, batches) == t_pred).float().mean().item() for k, m in students.items()}
    assert agree["soft"] > agree["plain"] + 0.1, agree


def _random_teacher(path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    teacher = timm.create_model(TEACHER, num_classes=10)
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, str(path))
    return path


def test_teacher_with_a_wrong_hash_prefix_is_refused(fm_wds, tmp_path):
    from convit_scale.cli import main

    teacher = _random_teacher(tmp_path / "regnety_002-deadbeef.safetensors")
    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    r = _recipe(tmp_path, "bad_hash", fm_wds, teacher, "fsdp2")
    assert main(["train", "--recipe", str(r)]) == 2
    assert not (tmp_path / "bad_hash").exists()
    good = teacher.rename(tmp_path / f"regnety_002-{sha[:8]}.safetensors")  # the right prefix loads
    from convit_scale.config import load_config
    from convit_scale.train.distill import build_teacher

    build_teacher(load_config(_recipe(tmp_path, "good_hash", fm_wds, good, "fsdp2")))


@pytest.mark.slow
def test_teacher_below_min_top1_is_refused_before_training(fm_wds, tmp_path):
    teacher = _random_teacher(tmp_path / "random.safetensors")
    r = _recipe(tmp_path, "weak", fm_wds, teacher, "fsdp2")
    res = run_cli("train", "--recipe", str(r), "distill.teacher_min_top1=50")
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "random.safetensors" in errors[0] and "teacher_min_top1 = 50" in errors[0]
    assert "teacher" in res.stdout and "validation images" in res.stdout
    assert records(tmp_path / "weak") == []  # not one training step


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A RegNetY with random weights, in a file named as DeiT names its teacher: the name alone proves nothing."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("teacher") / "regnety_160-a5fe301d.safetensors"
    save_file({k: v.contiguous() for k, v in timm.create_model(TEACHER, num_classes=10).state_dict().items()},
              str(path))
    return path


def _pinned_recipe(tmp_path, data, teacher, **distill_keys):
    from support import tiny_recipe

    return tiny_recipe(tmp_path / "r.yaml", "wds", data, tmp_path / "run",
                       distill={"enabled": True, "teacher_model": TEACHER, "teacher_checkpoint": str(teacher),
                                **distill_keys})


def test_a_renamed_teacher_whose_content_is_not_the_pinned_one_is_refused(fm_wds, teacher, tmp_path, capsys):
    """Named regnety_160-a5fe301d, or anything else: the recipe's pin is checked against the file's SHA-256."""
    from convit_scale.cli import main

    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    renamed = teacher.parent / "teacher.safetensors"
    renamed.write_bytes(teacher.read_bytes())
    for path in (teacher, renamed):
        r = _pinned_recipe(tmp_path, fm_wds, path, teacher_sha256="a5fe301d")
        assert main(["train", "--recipe", str(r)]) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert str(path) in line and sha in line and "does not start with a5fe301d" in line, line
        assert "distill.teacher_sha256" in line and "regnety_160-a5fe301d.pth" in line
        assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_pinned_file_loads_whatever_its_name_and_ranks_reuse_its_hash(fm_wds, teacher, tmp_path, monkeypatch):
    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    renamed = teacher.parent / "any_name.safetensors"
    renamed.write_bytes(teacher.read_bytes())
    cfg = load_config(_pinned_recipe(tmp_path, fm_wds, renamed, teacher_sha256=sha[:12]))
    distill.build_teacher(cfg)  # preflight: hashes the file, then keeps the hash in the run's folder
    cached = json.loads((tmp_path / "run" / distill.HASH_CACHE).read_text())
    assert cached["sha256"] == sha and cached["path"] == str(renamed.resolve())

    def no_rehash(*args):
        raise AssertionError("the teacher was hashed again")

    monkeypatch.setattr(distill, "_sha256", no_rehash)
    distill.build_teacher(cfg)  # another rank, or the job after a requeue: the run's folder has the hash
    renamed.write_bytes(teacher.read_bytes())  # the file changed (its modification time): hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        distill.build_teacher(cfg)


def test_the_accuracy_band_refuses_a_teacher_above_it(fm_wds, teacher, tmp_path, capsys):
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    plain = tmp_path / "plain.safetensors"
    plain.write_bytes(teacher.read_bytes())
    cfg = load_config(_pinned_recipe(tmp_path, fm_wds, plain, teacher_min_top1=0.0, teacher_max_top1=0.0))
    model = distill.build_teacher(cfg)
    loader = build_loader(DataConfig(format="wds", val_path=str(fm_wds), num_workers=0), LoaderSpec("val", 16, 50))
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), is_main=True)
    top1 = distill.evaluate(model, loader, ctx.device)["top1"]
    assert top1 > 0  # a random 10-class teacher gets some right
    with pytest.raises(BadInput, match=r"above distill.teacher_max_top1 = 0: wrong file"):
        distill.check_teacher(model, cfg, loader, ctx)
    cfg.distill.teacher_max_top1 = 100.0
    distill.check_teacher(model, cfg, loader, ctx)  # inside the band
    assert "teacher_max_top1 = 100" in capsys.readouterr().out
