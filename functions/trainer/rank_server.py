"""One rank of a sharded full fine-tuning engine: a process that holds this rank's part of
every sharded run of one base model and does what the coordinator (`sharded.py`) says.

The coordinator starts `world` of these (spawned, so CUDA and gloo start clean) and sends
each the same `(method, model_id, args)` in the same order over its pipe; a rank answers
`("ok", value)` or `("error", exception)`. Every method that runs collectives
(`ShardedFullRun`) is called on all ranks, so they stay in step. Invariants:
- A rank never decides anything: validation that could differ between ranks happens in the
  coordinator before the call, and the checks that run here (`validate_batch`) see the same
  arguments on every rank, so they fail on all or none.
- A rank's end of the pipe closing (the coordinator exited, or was killed) ends the rank.
- Tensors cross the pipe through `torch.multiprocessing`'s reductions (shared memory), not
  as pickled bytes.
"""

from __future__ import annotations

import logging
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor reductions)

from functions.compute.models import ModelFiles
from functions.trainer.fsdp import ShardedFullRun
from functions.trainer.precision import Precision
from openrl_core.errors import NotFound, OpenRLError, ServerError

log = logging.getLogger(__name__)
# A peer that died leaves the others in a collective; the coordinator kills them long before.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class Rank:
    def __init__(self, files: ModelFiles, device: str, precision: Precision) -> None:
        self.files, self.device, self.precision = files, device, precision
        self.runs: dict[str, ShardedFullRun] = {}

    def create(self, model_id: str) -> None:
        self.runs[model_id] = ShardedFullRun(self.files, self.device, self.precision)

    def drop(self, model_id: str) -> None:
        self.runs.pop(model_id, None)

    def forward_backward(self, model_id: str, batch, loss_fn, loss_fn_config, forward_only):
        return self._run(model_id).forward_backward(batch, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, model_id: str, params):
        return self._run(model_id).optim_step(params)

    def local_state(self, model_id: str):
        return self._run(model_id).local_state()

    def load_local_state(self, model_id: str, step: int, tensors) -> None:
        self._run(model_id).load_local_state(step, tensors)

    def gathered(self, model_id: str, dtype: str, rank0_only: bool = True):
        """The whole weights in `dtype` on the host (every rank gathers; rank 0 returns them)."""
        weights = self._run(model_id).gathered_weights()
        if rank0_only and dist.get_rank() != 0:
            return None
        return {name: t.to(getattr(torch, dtype)).cpu() for name, t in weights.items()}

    def local_bytes(self, model_id: str) -> int:
        return self._run(model_id).local_bytes()

    def park(self, model_id: str):
        return self._run(model_id).park()

    def restore(self, model_id: str):
        return self._run(model_id).restore()

    def _run(self, model_id: str) -> ShardedFullRun:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"model {model_id!r} is not loaded on this trainer")
        return run


def serve(rank: int, world: int, port: int, files: ModelFiles, device: str, precision: Precision, conn) -> None:
    """The rank process's main: join the group, then answer the coordinator until it goes."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}/{world}: %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=COLLECTIVE_TIMEOUT
    )
    server = Rank(files, device, precision)
    conn.send(("ready", None))
    while True:
        try:
            method, model_id, args = conn.recv()
        except (EOFError, OSError):
            break  # the coordinator is gone: so is this rank's reason to exist
        try:
            value = getattr(server, method)(model_id, *args)
            reply = ("ok", value)
        except OpenRLError as error:
            reply = ("error", error)
        except Exception as error:  # noqa: BLE001 (sent back whole: the coordinator decides)
            reply = ("error", ServerError(f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}"))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    dist.destroy_process_group()
