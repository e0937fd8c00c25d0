"""The wheel: every package of the tree and every shipped recipe, found with no repository around it."""

import shutil
import subprocess
import sys
import zipfile

from support import PY, REPO


def test_wheel_ships_every_package_and_recipe(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("convit_scale", "data_prep", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "tmp"),
                    str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "tmp").glob("convit_scale-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = sorted(p.relative_to(REPO / "recipes").as_posix() for p in (REPO / "recipes").rglob("*.yaml"))
    assert "cpu/demo.yaml" in recipes and "table1/convit_small.yaml" in recipes
    assert [r for r in recipes if f"convit_scale/recipes/{r}" not in names] == []
    packages = sorted(p.parent.relative_to(REPO).as_posix() for name in ("convit_scale", "data_prep")
                      for p in (REPO / name).rglob("__init__.py"))
    assert [p for p in packages if f"{p}/__init__.py" not in names] == [], "add the package to pyproject.toml"
    assert "convit_scale/cli/__main__.py" in names
    assert [n for n in names if n.startswith("convit_scale/_jpeg_roi.") and n.endswith(".so")], "the C library"
    assert "convit_scale/dryrun/driverless_cuda.cpp" in names  # plan --dry-run compiles it on first use
    # unpacked, the package finds its shipped recipes with no repository around it
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "from convit_scale.config import recipe_path; print(recipe_path('recipes/cpu/demo.yaml'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(site / "convit_scale" / "recipes" / "cpu" / "demo.yaml")
    _a_checkout_run_in_place_loads_the_installed_crop_decoder(src, site)


def _a_checkout_run_in_place_loads_the_installed_crop_decoder(checkout, site):
    """A container job: `python -m` from the mounted checkout (no library built in it) shadows the package the image
    installed (here the wheel, unpacked as pip installs it): the installed copy's crop-region decoder is loaded.
    Without one anywhere, a training run on FFCV or WebDataset refuses to start unless data.whole_jpeg_decode asks."""
    for built in (checkout / "convit_scale").glob("_jpeg_roi.*.so"):
        built.unlink()
    code = ("from convit_scale import jpeg_roi as j; print(j.__file__, j.LIBRARY, sep='\\n');"
            "print(j.refusal('wds', 'cpu', False)); print(j.refusal('wds', 'cpu', True), j.refusal('imagefolder', "
            "'cpu', False), j.refusal('ffcv', 'device', False))")
    env = {"PATH": "/usr/bin:/bin"}
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout,
                           env={**env, "PYTHONPATH": str(site)})
    assert found.returncode == 0, found.stderr[-2000:]
    module, library, refused, _ = found.stdout.splitlines()
    assert module == str(checkout / "convit_scale" / "jpeg_roi.py")  # the checkout's code ...
    assert library.startswith(str(site / "convit_scale" / "_jpeg_roi.")) and refused == "None"  # ... the image's
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout,
                           env=env)  # no installed copy either (the shared environment's is editable: nothing built)
    assert alone.returncode == 0, alone.stderr[-2000:]
    _, library, refused, others = alone.stdout.splitlines()
    assert library.startswith("convit_scale/_jpeg_roi.c is not built here and no installed convit-scale has it")
    assert refused.startswith("data.whole_jpeg_decode = false: the crop-region JPEG decoder is missing")
    assert others == "None None None"  # asked for, or not the loaders that crop-decode on the CPU
