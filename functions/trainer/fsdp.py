"""A full fine-tuning run sharded over the ranks of a process group with torch FSDP2.

`ShardedFullRun(files, group_rank, world)` is one rank's part of one run: every rank loads
the base in float32, each decoder layer and then the whole model is `fully_shard`ed over a
1-D device mesh, so each rank keeps 1/world of the master weights, their gradients and both
Adam moments (openrl_core/memory.py: `full_state_bytes(P, shards)`). Every rank must call
the same methods in the same order with the same arguments (they are collectives), as
`torchrun`-style SPMD programs do; the gloo backend runs it on CPU, NCCL on GPUs.

Invariants:
- A batch is split across ranks round-robin (datum i to rank i % world); each rank runs its
  datums as one pass, and a rank with none runs one datum with zero weights, so every rank
  runs the same collectives. The loss is Tinker's plain sum, so gradients are reduced as a
  SUM (`set_gradient_divide_factor(1)`), not FSDP's default mean: the result is the
  single-process run's gradient, up to float32 reduction order.
- The optimizer is `optimizer.adamw_step` over each rank's local shards, its moments plain
  named tensors shaped like those shards; the gradient norm for clipping and reporting is
  all-reduced (sum of squares), so it is the whole model's.
- `gathered_weights()` all-gathers full tensors (every rank takes part); publishing a
  sampler delta casts them to the serving dtype on rank 0 (`weight_sync.Publisher`).
- `save(path)` / `load(path)` write and read a torch distributed checkpoint
  (`torch.distributed.checkpoint`, one file per rank plus metadata): weights and moments stay
  sharded on disk; a run loaded with the same world size continues bitwise.
- bf16 precision: FSDP's MixedPrecisionPolicy gathers parameters in bf16 for compute and
  reduces gradients in float32 into the float32 shards.

- `local_state()` / `load_local_state()` are this rank's rows of a sharded safetensors
  checkpoint (`openrl_core/sharding.py`); `park()` / `restore()` move this rank's storages to
  host memory and back, bitwise.

The served trainer drives one of these per rank from `sharded.py` (`ShardedFullEngine`, the
ranks in `rank_server.py` processes) when `trainer_full_shards` > 1.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from functions.compute.models import ModelFiles, load_causal_lm
from functions.compute.weight_sync import Publication, Publisher, Put
from functions.trainer import batching, optimizer, passes
from functions.trainer.precision import Precision, decoder_layers
from openrl_core.datum import Datum, validate_batch
from openrl_core.errors import InvalidRequest
from openrl_core.losses import resolve_config
from openrl_core.params import AdamParams


def init_process_group(rank: int, world: int, address: str, port: int, backend: str = "gloo") -> None:
    """Join the run's process group (a TCP rendezvous at address:port, rank 0 serving it)."""
    os.environ.setdefault("MASTER_ADDR", address)
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"tcp://{address}:{port}")


class ShardedFullRun:
    def __init__(self, files: ModelFiles, device: str = "cpu", precision: Precision = Precision()) -> None:
        if not dist.is_initialized():
            raise InvalidRequest("a sharded run needs torch.distributed initialised (init_process_group)")
        self._files = files
        self._device = torch.device(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.precision = precision
        model = load_causal_lm(files, dtype=torch.float32, device=device)
        model.eval()  # no dropout: a step is a deterministic function of weights and data
        model.requires_grad_(True)
        precision.prepare(model)
        mesh = init_device_mesh(self._device.type, (self.world,))
        policy = MixedPrecisionPolicy(
            param_dtype=None if precision.name == "float32" else torch.bfloat16, reduce_dtype=torch.float32
        )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        # The root unit is the objective, not the HF model: a pass calls the decoder and lm_head
        # separately (batching.target_logprobs), and FSDP gathers a unit's parameters in its
        # forward hooks, so the root's own (embeddings, final norm, lm_head) must be gathered
        # around the call that uses them.
        objective = _Objective(model)
        fully_shard(objective, mesh=mesh, mp_policy=policy)
        for unit in [*decoder_layers(model), objective]:  # every unit: the setting is per unit
            unit.set_gradient_divide_factor(1.0)  # the loss is a sum: gradients add up across ranks
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        self.model, self._objective = model, objective
        self.params = dict(model.named_parameters())  # DTensors, tied weights once
        self.adam = optimizer.fresh_state(self._local_params())
        self._parked: list | None = None  # (storage, host copy) while parked

    # -- training ---------------------------------------------------------------------------

    def forward_backward(
        self, batch: list[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None, forward_only: bool = False
    ) -> passes.ForwardBackwardResult:
        """The whole batch's result on every rank: summed loss, every datum's logprobs."""
        config = resolve_config(loss_fn, loss_fn_config)
        validate_batch(batch, loss_fn, self._files.vocab_size)
        mine = list(range(self.rank, len(batch), self.world))
        part = [batch[i] for i in mine] or [_zero_weight(batch[0])]
        # One pass per rank (no microbatches): every rank runs the same collectives.
        with torch.set_grad_enabled(not forward_only):
            with self.precision.autocast(self._device):
                logprobs_D = self._objective(part)
            loss = passes.batch_loss(loss_fn, config, part, logprobs_D, self._device)
            if loss.requires_grad:
                loss.backward()
        values = [x.detach().cpu().numpy().astype(np.float32, copy=False) for x in logprobs_D] if mine else []
        total = torch.tensor([float(loss.detach()) if mine else 0.0], dtype=torch.float64)
        dist.all_reduce(total)
        pieces: list = [None] * self.world
        dist.all_gather_object(pieces, (mine, values))
        logprobs: list = [None] * len(batch)
        for indices, values in pieces:
            for index, value in zip(indices, values):
                logprobs[index] = value
        return passes.ForwardBackwardResult(logprobs=logprobs, metrics={"loss:sum": float(total[0])})

    def optim_step(self, hp: AdamParams) -> dict[str, float]:
        local = self._local_params()
        grad_norm = optimizer.adamw_step(local, self.adam, hp, grad_norm_of=_all_reduced_norm)
        for p in self.params.values():
            p.grad = None
        return {"optim/grad_norm": grad_norm, "optim/lr": float(hp.learning_rate)}

    # -- weights and checkpoints --------------------------------------------------------------

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """Full float32 tensors on every rank (an all-gather per parameter)."""
        return {name: p.detach().full_tensor().clone() for name, p in self.params.items()}

    def publish(self, publisher: Publisher, version: int, put: Put) -> Publication | None:
        """Sampler weights from the gathered model: every rank gathers (a collective), rank 0
        publishes them in the serving dtype (a sparse delta or a full checkpoint); others get None."""
        weights = self.gathered_weights()
        return publisher.publish(weights, version, put) if self.rank == 0 else None

    def local_bytes(self) -> int:
        """This rank's resident bytes: weight shards, gradient shards, both moments."""
        return 16 * sum(t.numel() for t in self._local_params().values())  # float32 x 4 (memory.py)

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._checkpoint_state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(path))
        self.adam.step = int(state["step"].item())
        for p in self.params.values():
            p.grad = None

    def local_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """This rank's rows of the weights and both moments (host copies, keys `model/NAME`,
        `exp_avg/NAME`, `exp_avg_sq/NAME`), and the step count: what a sharded checkpoint file
        of this rank holds."""
        tensors: dict[str, torch.Tensor] = {}
        for name, shard in self._local_params().items():
            tensors[f"model/{name}"] = shard.detach().to("cpu", copy=True).contiguous()
            tensors[f"exp_avg/{name}"] = self.adam.exp_avg[name].to("cpu", copy=True).contiguous()
            tensors[f"exp_avg_sq/{name}"] = self.adam.exp_avg_sq[name].to("cpu", copy=True).contiguous()
        return self.adam.step, tensors

    @torch.no_grad()
    def load_local_state(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's rows (as `local_state` gives them, checked by the caller) into the
        shards in place; pending gradients are dropped (a load is a clean point)."""
        for name, shard in self._local_params().items():
            shard.copy_(tensors[f"model/{name}"].to(shard.device))
            self.adam.exp_avg[name].copy_(tensors[f"exp_avg/{name}"].to(shard.device))
            self.adam.exp_avg_sq[name].copy_(tensors[f"exp_avg_sq/{name}"].to(shard.device))
        self.adam.step = int(step)
        for p in self.params.values():
            p.grad = None

    # -- parking: this rank's storages to host memory and back ------------------------------

    def park(self) -> tuple[float, int]:
        """Copy every storage this rank's shards live in (FSDP's padded shard buffers, pending
        gradient shards, the moments) to host memory and resize it to nothing. Resizing the
        storage, not swapping tensors, keeps every view FSDP holds valid: restoring brings the
        same bytes back under the same tensor objects. Idempotent."""
        if self._parked is not None:
            return 0.0, 0
        started = time.perf_counter()
        host = []
        for storage in self._storages():
            if storage.device.type == "cuda":
                copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
                copy.copy_(storage, non_blocking=True)
            else:
                copy = storage.clone()
            host.append((storage, copy))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        for storage, _ in host:
            storage.resize_(0)
        self._parked = host
        return time.perf_counter() - started, sum(copy.nbytes() for _, copy in host)

    def restore(self) -> tuple[float, int]:
        if self._parked is None:
            return 0.0, 0
        started = time.perf_counter()
        for storage, copy in self._parked:
            storage.resize_(copy.nbytes())
            storage.copy_(copy, non_blocking=True)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        nbytes = sum(copy.nbytes() for _, copy in self._parked)
        self._parked = None
        return time.perf_counter() - started, nbytes

    # -- internals --------------------------------------------------------------------------

    def _storages(self) -> list:
        """Each distinct storage behind this rank's shards, gradients and moments, once."""
        tensors = []
        for p in self.params.values():
            tensors.append(p.to_local() if isinstance(p, DTensor) else p.data)
            if p.grad is not None:
                tensors.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        tensors += [*self.adam.exp_avg.values(), *self.adam.exp_avg_sq.values()]
        seen: dict[int, object] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def _local_params(self) -> dict[str, torch.Tensor]:
        """Each parameter's local shard as a leaf tensor sharing its storage, its gradient the
        local shard of the DTensor's gradient (so the optimizer updates the shards in place)."""
        local = {}
        for name, p in self.params.items():
            shard = p.to_local().detach() if isinstance(p, DTensor) else p.detach()
            grad = p.grad
            if grad is not None:
                shard.grad = grad.to_local() if isinstance(grad, DTensor) else grad
            local[name] = shard
        return local

    def _checkpoint_state(self) -> dict:
        """Weights as DTensors (DCP keeps their sharding), moments as DTensors over the same mesh."""
        state: dict = {"step": torch.tensor(self.adam.step, dtype=torch.int64)}
        for name, p in self.params.items():
            state[f"model/{name}"] = p.data
            for kind, moments in (("exp_avg", self.adam.exp_avg), ("exp_avg_sq", self.adam.exp_avg_sq)):
                state[f"{kind}/{name}"] = DTensor.from_local(
                    moments[name], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
                )
        return state


class _Objective(torch.nn.Module):
    """The root FSDP unit: a batch's target logprobs through the model's decoder and lm_head."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: list[Datum]) -> list[torch.Tensor]:
        logprobs_D = batching.target_logprobs(self.model.get_decoder(), self.model.get_output_embeddings(), batch)
        return [x.clone() for x in logprobs_D]  # not views: FSDP hooks its outputs for the backward


def _zero_weight(datum: Datum) -> Datum:
    """A datum that contributes nothing: a rank without data still runs the collectives."""
    inputs = dict(datum.loss_fn_inputs)
    if "weights" in inputs:
        inputs["weights"] = np.zeros_like(np.asarray(inputs["weights"], np.float32))
    elif "advantages" in inputs:
        inputs["advantages"] = np.zeros_like(np.asarray(inputs["advantages"], np.float32))
    return Datum(datum.tokens_N, inputs)


def _all_reduced_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    squares = torch.zeros((), dtype=torch.float32)
    for g in grads:
        squares = squares + torch.linalg.vector_norm(g).square()
    dist.all_reduce(squares)
    return squares.sqrt()
