"""The benchmarks as a package (convit_scale/bench/): one GPU table with the planner, and every benchmark but `bench
data` importable without FFCV. Each benchmark's own tests are in the file named after its module."""



from convit_scale import planner
from convit_scale.hardware import GPUS, peak_tflops_of


def test_one_gpu_table_for_planner_and_mfu():
    assert planner.GPUS is GPUS
    assert peak_tflops_of("NVIDIA H200") == GPUS["h200-141gb"].peak_tflops == 989
    assert peak_tflops_of("NVIDIA GH200 480GB") == GPUS["gh200-96gb"].peak_tflops
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312  # not the A10 inside "A100"
    assert peak_tflops_of("NVIDIA A10") == 125 and peak_tflops_of("NVIDIA L40S") == 362
    assert peak_tflops_of("Some Future GPU") is None


NO_FFCV = """
import importlib, sys
class NoFfcv:
    def find_spec(self, name, path=None, target=None):
        if name == "ffcv" or name.startswith("ffcv."):
            raise ImportError(f"No module named {name!r} (blocked: a machine without FFCV)")
sys.meta_path.insert(0, NoFfcv())
import convit_scale.bench
from convit_scale.bench.__main__ import WORKERS
for kind in ("model", "train", "inference", "distill", "gate", "startup"):
    importlib.import_module("convit_scale.bench." + WORKERS[kind])
for name in ("memory", "universal"):
    importlib.import_module("convit_scale.bench." + name)
try:
    importlib.import_module("convit_scale.bench.data")
except ImportError as e:
    print("data:", e)
"""


def test_bench_imports_without_ffcv():
    """A GPU machine without FFCV (it builds from source) still runs every benchmark but ``bench data``: the
    benchmarks' dispatchers import only the benchmark that runs. The blocker is real: ``bench.data`` then fails."""
    import subprocess
    import sys

    from support import REPO

    res = subprocess.run([sys.executable, "-c", NO_FFCV], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "data: No module named 'ffcv" in res.stdout, res.stdout
