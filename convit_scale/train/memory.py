"""Memory per rank: the peak of the training steps (always logged) and the live tensors after backward
(``log.debug_memory``)."""

from __future__ import annotations

import gc
import resource

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank since the last ``reset_peak_memory`` (process start if never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM can be reset (see below); ru_maxrss cannot
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start peak tracking at the training steps: set-up (a whole model built before sharding,
    DeepSpeed's partitioning copies) has its own, earlier peak, which `setup_peak_mem_mb` records."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak resident set size (VmHWM)
    except OSError:
        pass


def tensor_memory_mb(device: torch.device, module: torch.nn.Module) -> float:
    """Memory held by live tensors on this rank. Taken after backward, before the optimizer step: the
    model state (parameters, gradients, optimizer moments) and the strategy's persistent buffers, without
    allocator slack, freed activations or the communication library's own buffers. CUDA: the caching
    allocator's count; CPU: every tensor storage reachable from Python, each counted once (views and
    shards of one flat buffer included); tensors that live only in C++ (DDP's reducer buckets) are not
    seen."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    grads = [p.grad for p in module.parameters()]  # noqa: F841 (gives autograd's gradients a Python object)

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:  # dead weak proxies raise on isinstance; wrapper subclasses (DTensor) have no storage of
            # their own (their local tensors are seen)
            if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except (ReferenceError, RuntimeError, NotImplementedError, TypeError):
            continue
        storages[ptr] = max(storages.get(ptr, 0), nbytes)
    return sum(storages.values()) / 2**20
