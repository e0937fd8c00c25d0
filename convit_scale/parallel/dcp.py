"""Model + optimizer state through torch.distributed.checkpoint (DDP and FSDP2): sharded, and resharded on load,
so a checkpoint resumes on another world size."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .. import comm


class DCPStateMixin:
    scaler: torch.amp.GradScaler | None = None
    _writer: FileSystemWriter | None = None
    """The background saves' writer, which keeps their staging buffers (one save in flight at a time)."""

    def _state(self):
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, directory: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(directory / "dcp"))
        self._save_scaler(directory)

    def _save_scaler(self, directory: Path) -> None:
        if self.scaler is not None and comm.rank() == 0:  # the same on every rank
            torch.save(self.scaler.state_dict(), directory / "grad_scaler.pt")

    def save_async(self, directory: Path):
        """DCP's ``async_save``: the state is copied to host memory here (into pinned buffers kept from one save to
        the next on GPUs, as torchtitan stages); the files are written by a background thread, whose collectives go
        through a gloo group of their own (under NCCL the step's collectives go on). Returns the future of the
        write."""
        group = self.background_group()
        if self._writer is None:  # pinned staging needs CUDA; on the CPU each save copies into fresh memory
            self._writer = FileSystemWriter(str(directory / "dcp"), cache_staged_state_dict=torch.cuda.is_available())
        self._save_scaler(directory)
        return dcp.async_save(self._state(), checkpoint_id=str(directory / "dcp"), storage_writer=self._writer,
                              process_group=group)

    def load(self, directory: Path, saved_world_size: int | None = None) -> None:
        state = self._state()  # DCP reshards: any saved world size loads
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.scaler is not None and (directory / "grad_scaler.pt").is_file():
            self.scaler.load_state_dict(torch.load(directory / "grad_scaler.pt", weights_only=True))

    def full_state_dict(self):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, _ = get_state_dict(self.module, [], options=opts)
        return model_sd if comm.rank() == 0 else None

    def load_full_state_dict(self, state):
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_state_dict(self.module, [], model_state_dict=state, options=opts)
