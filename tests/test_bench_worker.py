"""The benchmarks' worker process (convit_scale/bench/worker.py): a timed step measured in a fresh process, timed
workers run with training's malloc."""

from convit_scale.bench import worker


def test_timed_step_measures_a_training_step():
    """In a fresh worker, as `bench model` runs it: in this long-lived process freed heap is reused, the step adds
    nothing to the RSS and its peak is 0 give or take the kernel's approximate page counts (-0.03 MB was seen)."""
    spec = {"model": ["convit_nano", "fast"], "batch": 2, "img_size": 16, "steps": 2, "warmup": 1,
            "device": "cpu", "precision": "fp32"}
    r = worker.run_worker("model", spec, memory=True)
    assert r["images_per_s"] > 0 and r["peak_mb"] > 1  # what build loads and makes: about 25 MB


COPY_FAULTS = """
import resource, statistics, torch
crops = torch.zeros(64, 224, 224, 3, dtype=torch.uint8)  # a loader's reused buffer
faults = []
for _ in range(24):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    batch = crops.clone()  # what leaves the loader each batch
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    del batch
print(statistics.median(faults[-8:]))  # glibc settles after a few: its threshold rises as blocks are freed
"""


def test_timed_workers_copy_batches_as_training_does():
    """Workers whose times are read run with training's malloc, not the memory benchmarks' (RSS_ENV): there a batch
    copied out of a loader would page-fault all its 9.6 MB afresh (and unmap it across cores) every batch."""
    import subprocess
    import sys

    def faults_per_copy(memory: bool) -> float:
        out = subprocess.run([sys.executable, "-c", COPY_FAULTS], env=worker.worker_env(memory), capture_output=True,
                             text=True, check=True)
        return float(out.stdout.split()[-1])

    assert faults_per_copy(memory=False) < 100
    assert worker.worker_env(memory=True).items() >= worker.RSS_ENV.items()  # where the copy faults, page by page
