"""Recipe config: inheritance, overrides, strict validation with messages naming key and file."""

import pytest

from convit_scale.cli import main
from convit_scale.config import RECIPES, Config, ConfigError, field_docs, load_config


def _write(path, text):
    path.write_text(text)
    return path


def test_defaults_are_the_deit_recipe():
    cfg = load_config()
    assert cfg.optim.weight_decay == 0.05 and cfg.optim.eps == 1e-8 and cfg.optim.grad_clip is None
    assert cfg.schedule.epochs == 300 and cfg.schedule.warmup_epochs == 5
    assert cfg.schedule.warmup_lr == 1e-6 and cfg.schedule.min_lr == 1e-5
    assert cfg.data.mixup == 0.8 and cfg.data.cutmix == 1.0 and cfg.data.reprob == 0.25
    assert cfg.data.rand_augment == "rand-m9-mstd0.5-inc1" and cfg.data.repeated_aug == 3
    assert cfg.model.drop_path_rate == 0.1 and cfg.data.label_smoothing == 0.1


def test_inheritance_and_overrides(tmp_path):
    (tmp_path / "t1").mkdir()
    _write(tmp_path / "t1" / "base.yaml", "model: {name: convit_small}\noptim: {base_lr: 5e-4}\n")
    child = _write(tmp_path / "child.yaml", "base: t1/base.yaml\ndata: {global_batch_size: 512}\n")
    cfg = load_config(child, ["optim.base_lr=4e-4", "parallel.strategy=zero3", "data.rand_augment=null"])
    assert cfg.model.name == "convit_small"
    assert cfg.optim.base_lr == pytest.approx(4e-4)
    assert cfg.data.global_batch_size == 512 and cfg.parallel.strategy == "zero3"
    assert cfg.data.rand_augment is None


def test_a_recipe_of_ones_own_builds_on_a_shipped_one_by_its_name(tmp_path):
    """``base:`` is looked up beside the including file, then among the shipped recipes (by the name they have under
    recipes/, with or without that folder); a base found nowhere is refused naming the file and each path tried."""
    mine = _write(tmp_path / "mine.yaml", "base: table1/convit_base_plus.yaml\nrun: {output_dir: runs/mine}\n")
    cfg = load_config(mine)
    assert cfg.model.name == "convit_base_plus" and cfg.data.global_batch_size == 512
    assert cfg.run.output_dir == "runs/mine"
    also = _write(tmp_path / "also.yaml", "base: [recipes/table1/convit_base_plus.yaml, mine.yaml]\n")
    assert load_config(also).run.output_dir == "runs/mine"
    lost = _write(tmp_path / "lost.yaml", "base: table1/convit_bsae_plus.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(lost)
    assert str(e.value) == (f"{lost}: base table1/convit_bsae_plus.yaml not found; tried "
                            f"{tmp_path / 'table1/convit_bsae_plus.yaml'}, {RECIPES / 'table1/convit_bsae_plus.yaml'}"
                            f"; allowed: a recipe relative to lost.yaml, or a shipped recipe's name "
                            f"(table1/convit_base.yaml)")


def test_a_run_of_another_model_is_not_set_beside_the_recipes_paper_row():
    """The paper row of a recipe is its model's: an override of model.name drops it (the end of the run compares
    nothing, config.yaml has no paper row); other overrides, or the recipe's own model named again, keep it."""
    recipe = RECIPES / "table1" / "convit_base_plus.yaml"
    assert load_config(recipe, ["optim.base_lr=1e-4"]).paper.top1 == 82.5
    assert load_config(recipe, ["model.name=convit_base_plus"]).paper.row == "ConViT-B+"
    other = load_config(recipe, ["model.name=convit_nano", "model.num_classes=10"]).paper
    assert (other.table, other.row, other.top1) == (None, None, None)


@pytest.mark.parametrize("text,needle", [
    ("optim: {lrr: 1}\n", "unknown key 'optim.lrr'; allowed keys in 'optim': base_lr"),
    ("bogus: {a: 1}\n", "unknown key 'bogus'; allowed keys at the top level: model, data"),
    ("parallel: {strategy: zero4}\n", "parallel.strategy = 'zero4' is not allowed; expected one of 'none', 'ddp'"),
    ("data: {global_batch_size: 12.5}\n", "data.global_batch_size = 12.5 is not allowed; expected int"),
    ("data: {global_batch_size: 0}\n", "data.global_batch_size = 0 is not allowed; must be >= 1"),
    ("model: {name: convit_huge}\n", "model.name = 'convit_huge' is not allowed; known models: deit_tiny"),
    ("schedule: {epochs: 10, warmup_epochs: 20}\n", "schedule.warmup_epochs = 20.0 is not allowed"),
    ("distill: {enabled: true}\n", "distill.teacher_checkpoint = None is not allowed"),
    ("model: {img_size: 100}\n",
     "model.img_size = 100 is not allowed; the image size (100) must be a positive multiple"),
    ("model: {patch_size: 15}\n",
     "model.patch_size = 15 is not allowed; the image size (224) must be a positive multiple of the patch size (15)"),
    ("model: {patch_size: 0}\n", "model.patch_size = 0 is not allowed; must be a positive number"),
    ("data: {subset_fraction: 0}\n", "data.subset_fraction = 0.0 is not allowed"),
    ("run: {seed: true}\n", "run.seed = True is not allowed; expected int"),
    ("model: 3\n", "'model' must be a mapping"),
    ("parallel: {strategy: ddp, zero_bucket_elements: 1000}\n",
     "parallel.zero_bucket_elements = 1000 is not allowed; needs"),
    ("parallel: {strategy: zero3, zero_bucket_elements: 0}\n",
     "parallel.zero_bucket_elements = 0 is not allowed; must be a positive multiple of 8"),
    ("parallel: {strategy: zero3, compile: true}\n",
     "parallel.compile = True is not allowed; is supported with ddp and fsdp2"),
    ("parallel: {strategy: fsdp2, precision: fp16}\n",
     "parallel.precision = 'fp16' is not allowed; fsdp2 trains in fp32 or bf16"),
    ("checkpoint: {every_epochs: 0}\n", "checkpoint.every_epochs = 0 is not allowed; must be >= 1, or null"),
    ("fault: {nccl_trace_entries: -1}\n", "fault.nccl_trace_entries = -1 is not allowed; must be >= 0"),
])
def test_bad_values_are_refused_naming_key_and_file(tmp_path, text, needle):
    f = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value) and str(f) in str(e.value)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'optim.nope'"):
        load_config(None, ["optim.nope=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["optim.base_lr"])
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(tmp_path / "missing.yaml")
    loop = _write(tmp_path / "loop.yaml", "base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(loop)


def test_every_field_has_help_text():
    import dataclasses

    for section in dataclasses.fields(Config):
        cls = (section.type if isinstance(section.type, type)
               else eval(section.type, vars(__import__("convit_scale.config").config)))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_config_command_prints_resolved_yaml_and_refuses_bad_keys(tmp_path, capsys):
    f = _write(tmp_path / "r.yaml", "model: {name: deit_small}\n")
    assert main(["config", str(f), "optim.base_lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "name: deit_small" in out and "base_lr: 0.001" in out
    assert main(["config", str(f), "optim.bad=1"]) == 2
    assert "unknown key 'optim.bad'" in capsys.readouterr().err


def test_crop_scale_reaches_the_random_resized_crop():
    from timm.data.transforms import RandomResizedCropAndInterpolation

    from convit_scale.data.transforms import build_train_transform

    d = load_config(RECIPES / "cpu" / "demo.yaml").data
    for on_device in (False, True):
        crops = [t for t in build_train_transform(d, 28, on_device=on_device).transforms
                 if isinstance(t, RandomResizedCropAndInterpolation)]
        assert len(crops) == 1 and tuple(crops[0].scale) == (0.8, 1.0)


def test_patch_size_reaches_the_model():
    from convit_scale.config import model_options
    from convit_scale.models import create_model

    cfg = load_config(None, ["model.name=convit_micro", "model.img_size=28", "model.patch_size=7"])
    model = create_model(cfg.model.name, **model_options(cfg.model))
    assert model.patch_embed.patch_size == (7, 7) and model.patch_embed.num_patches == 16


def test_the_hsdp_mesh_follows_the_ranks_per_node():
    """parallel.hsdp_per_node: one replica per node, whatever the node count of this start (4 x 8, then 3 x 8 after
    a node is lost); an explicit hsdp_replicas is kept where its shard groups stay inside nodes (or span whole ones),
    else one replica per node with a line for the log, never a refusal (a resume on another world size)."""
    from convit_scale.config import ParallelConfig

    per_node = ParallelConfig(hsdp_per_node=True)
    assert per_node.hsdp_mesh(32, 8) == (4, None) and per_node.hsdp_mesh(24, 8) == (3, None)
    assert per_node.hsdp_mesh(8, 8) == (1, None) and ParallelConfig().hsdp_mesh(32, 8) == (1, None)
    assert ParallelConfig(hsdp_replicas=4).hsdp_mesh(32, 8) == (4, None)
    assert ParallelConfig(hsdp_replicas=2).hsdp_mesh(32, 8) == (2, None)  # shard groups of 2 whole nodes
    assert ParallelConfig(hsdp_replicas=4).hsdp_mesh(24, 8) == (3, "parallel.hsdp_replicas = 4 does not fit 24 ranks "
                                                                  "of 8 per node: 3 replica(s), one per node, instead")
    assert ParallelConfig(hsdp_replicas=5).hsdp_mesh(24, 8)[0] == 3
