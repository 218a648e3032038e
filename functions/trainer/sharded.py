"""Full fine-tuning sharded over several devices with torch FSDP2: the coordinator.

`ShardedFullEngine` answers the calls `FullFinetuneEngine` answers (create, forward_backward,
optim_step, export/copy/import state, export_external, publish, park/restore), so the worker,
forks and recovery drive it alike; behind them, `world` rank processes (`rank_server.py`) each
hold their part of every run (`fsdp.ShardedFullRun`: 1/world of the float32 weights,
gradients and AdamW moments). Rank r computes on `cuda:r` over NCCL, or on the CPU over gloo.

Invariants:
- Every call goes to all ranks in the same order (they run collectives); the coordinator
  holds no tensors of a run beyond a sampler publisher's last published bits.
- Checkpoints are sharded (`full_files.py`): `save_state` writes each rank's rows as they
  are, no gather; `load_state` reads sharded checkpoints of any shard count and whole ones
  (merged, then split by rows), so a checkpoint moves between this engine, the single-device
  one and other shard counts. Every check of a checkpoint comes before any write.
- Sampler weights and `save_weights_external` come from the gathered weights (rank 0).
- A rank that dies (kill -9, OOM) leaves its peers inside a collective: the coordinator
  notices (the process is gone), kills the other ranks and calls `on_rank_lost`, which in a
  served trainer ends the process (`os._exit`) so that its supervisor starts a replacement
  that recovers every run by snapshot and replay (`recovery.py`), losing and doubling nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.multiprocessing as mp

from functions.compute.models import ModelFiles, parameter_count
from functions.compute.weight_sync import Publication, Publisher, Put
from functions.local_server import free_port
from functions.trainer import full_files, optimizer, rank_server, tensor_files
from functions.trainer.full import MARKER_FORMAT, TOKENIZER_FILES, is_full_state
from functions.trainer.passes import ForwardBackwardResult
from functions.trainer.precision import Precision
from openrl_core import memory
from openrl_core.datum import Datum, validate_batch
from openrl_core.errors import Conflict, InvalidRequest, NotFound, ServerError
from openrl_core.params import AdamParams

log = logging.getLogger(__name__)
EXIT_RANK_LOST = 70  # EX_SOFTWARE: the supervisor restarts the trainer
START_SECONDS = 300.0


class RankLost(ServerError):
    pass


def _exit_process(error: RankLost) -> None:
    log.critical("trainer: %s; exiting so that a replacement recovers every run by replay", error)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


class ShardedFullEngine:
    def __init__(
        self,
        files: ModelFiles,
        world: int,
        device: str = "cpu",
        serving_dtype: str = "bfloat16",
        full_every: int = 20,
        max_share: float = 0.5,
        precision: Precision = Precision(),
        on_rank_lost: Callable[[RankLost], None] = _exit_process,
    ) -> None:
        if world < 2:
            raise ValueError("a sharded engine has at least two ranks (one is FullFinetuneEngine)")
        self._files = files
        self.world = world
        self.precision = precision
        self._serving = (serving_dtype, full_every, max_share)
        self._on_rank_lost = on_rank_lost
        self._publishers: dict[str, Publisher] = {}
        self._parked: set[str] = set()
        # Host tensors never written (the OS maps no pages for them): shapes to check against.
        self._shapes = {name: torch.empty(shape) for name, shape in _parameter_shapes(files).items()}
        cuda = torch.device(device).type == "cuda"
        if cuda and torch.cuda.device_count() < world:
            raise ValueError(f"{world} shards need {world} GPUs; this node has {torch.cuda.device_count()}")
        context = mp.get_context("spawn")
        port = free_port()
        self._ranks, self._conns = [], []
        for rank in range(world):
            ours, theirs = context.Pipe()
            rank_device = f"cuda:{rank}" if cuda else "cpu"
            process = context.Process(
                target=rank_server.serve, args=(rank, world, port, files, rank_device, precision, theirs),
                name=f"openrl-rank-{rank}", daemon=True,
            )  # fmt: skip
            process.start()
            theirs.close()
            self._ranks.append(process)
            self._conns.append(ours)
        self._lost: Optional[RankLost] = None
        self._losing = threading.Lock()
        self._closing = threading.Event()
        for rank in range(world):
            self._receive(rank, START_SECONDS)
        # A rank can die while the trainer is idle; found here, it is fatal at once, not at the
        # run's next request (which could be hours away, with the run's devices held meanwhile).
        threading.Thread(target=self._watch, name="openrl-rank-watch", daemon=True).start()
        log.info("trainer: %d FSDP ranks of %s ready (pids %s)", world, files.name, self.pids)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._ranks]

    def close(self) -> None:
        self._closing.set()
        for conn in self._conns:
            conn.close()
        for process in self._ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    # -- runs ------------------------------------------------------------------------------

    def state_bytes_estimate(self) -> int:
        """One rank's bytes: the timeslicer's budget is per device, and every rank holds this."""
        return memory.full_state_bytes(parameter_count(self._files), self.world)

    def state_bytes(self, model_id: str) -> int:
        self._require(model_id)
        return self.state_bytes_estimate()

    def create(self, model_id: str) -> None:
        if model_id in self._publishers:
            raise Conflict(f"model {model_id!r} already exists")
        self._call("create", model_id)
        dtype, full_every, max_share = self._serving
        self._publishers[model_id] = Publisher(model_id, self._files.name, dtype, full_every, max_share)

    def has(self, model_id: str) -> bool:
        return model_id in self._publishers

    def drop(self, model_id: str) -> None:
        if self._publishers.pop(model_id, None) is not None:
            self._call("drop", model_id)
        self._parked.discard(model_id)

    # -- training --------------------------------------------------------------------------

    def forward_backward(
        self, model_id: str, batch: list[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult:  # fmt: skip
        self._require(model_id)
        validate_batch(batch, loss_fn, self._files.vocab_size)  # here first: a bad batch reaches no rank
        return self._call("forward_backward", model_id, batch, loss_fn, loss_fn_config, forward_only)[0]

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        self._require(model_id)
        return self._call("optim_step", model_id, params)[0]

    # -- checkpoints -----------------------------------------------------------------------

    def export_state(self, model_id: str) -> dict[str, bytes]:
        return self.copy_state(model_id)()

    def copy_state(self, model_id: str) -> Callable[[], dict[str, bytes]]:
        """Each rank's rows copied now (the reply is a host copy); encoded later, anywhere."""
        self._require(model_id)
        replies = self._call("local_state", model_id)
        step = replies[0][0]
        pieces = [tensors for _, tensors in replies]
        marker = {"format": MARKER_FORMAT, "base_model": self._files.name}
        return lambda: full_files.sharded_files(marker, step, self.world, pieces)

    def import_state(self, model_id: str, files: Mapping[str, bytes], with_optimizer: bool) -> None:
        """Load a full run's checkpoint (sharded with any shard count, or whole) into `model_id`,
        created from the base if missing; every check comes before any rank is written."""
        if not is_full_state(files):
            raise InvalidRequest("this is a LoRA checkpoint; the run trains every weight (full fine-tuning)")
        step, tensors = self._checked_tensors(files, with_optimizer)
        created = model_id not in self._publishers
        if created:
            self.create(model_id)
        pieces = full_files.split(tensors, self.world)
        try:
            self._call_each("load_local_state", model_id, [(step, piece) for piece in pieces])
        except InvalidRequest:
            if created:
                self.drop(model_id)
            raise

    def export_external(self, model_id: str) -> dict[str, bytes]:
        """A Hugging Face model directory's files from the gathered float32 weights."""
        self._require(model_id)
        weights = self._call("gathered", model_id, "float32")[0]
        config = json.loads((Path(self._files.path) / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = "float32"
        out = {
            "config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
            full_files.WEIGHTS_FILE: tensor_files.save(weights, metadata={"format": "pt"}),
        }
        for name in TOKENIZER_FILES:
            source = Path(self._files.path) / name
            if source.exists():
                out[name] = source.read_bytes()
        return out

    def publish(self, model_id: str, version: int, put: Put) -> Publication:
        """Sampler weights: gathered on rank 0 already in the serving dtype (half the bytes over
        the pipe; the publisher's own cast of them is then exact)."""
        publisher = self._require(model_id)
        weights = self._call("gathered", model_id, self._serving[0])[0]
        return publisher.publish(weights, version, put)

    # -- parking (every rank its own shards) -------------------------------------------------

    def park(self, model_id: str) -> tuple[float, int]:
        self._require(model_id)
        replies = self._call("park", model_id)
        self._parked.add(model_id)
        return max(seconds for seconds, _ in replies), sum(nbytes for _, nbytes in replies)

    def restore(self, model_id: str) -> tuple[float, int]:
        self._require(model_id)
        replies = self._call("restore", model_id)
        self._parked.discard(model_id)
        return max(seconds for seconds, _ in replies), sum(nbytes for _, nbytes in replies)

    def is_parked(self, model_id: str) -> bool:
        self._require(model_id)
        return model_id in self._parked

    # -- introspection (tests) -----------------------------------------------------------

    def weights(self, model_id: str) -> dict[str, torch.Tensor]:
        self._require(model_id)
        return self._call("gathered", model_id, "float32")[0]

    def local_bytes(self, model_id: str) -> list[int]:
        return self._call("local_bytes", model_id)

    # -- internals -------------------------------------------------------------------------

    def _require(self, model_id: str) -> Publisher:
        publisher = self._publishers.get(model_id)
        if publisher is None:
            raise NotFound(f"model {model_id!r} is not loaded on this trainer")
        return publisher

    def _checked_tensors(self, files: Mapping[str, bytes], with_optimizer: bool) -> tuple[int, dict]:
        """(step, whole `model/` and moment tensors) of a checkpoint that fits this base."""
        whole = full_files.whole(files)
        weights = tensor_files.read(whole, full_files.WEIGHTS_FILE)
        tensor_files.check_fit(weights, self._shapes, full_files.WEIGHTS_FILE, self._files.name)
        tensors = {f"model/{name}": t.to(torch.float32) for name, t in weights.items()}
        state = (
            optimizer.state_from_files(whole, self._shapes) if with_optimizer else optimizer.fresh_state(self._shapes)
        )
        if not isinstance(state, optimizer.AdamState):
            raise InvalidRequest("full fine-tuning trains with AdamW; this checkpoint holds another optimizer's state")
        for kind, moments in (("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
            tensors.update({f"{kind}/{n}": t.to(torch.float32) for n, t in moments.items()})
        return state.step, tensors

    def _call(self, method: str, model_id: str, *args) -> list:
        return self._call_each(method, model_id, [args] * self.world)

    def _call_each(self, method: str, model_id: str, args_per_rank: list) -> list:
        if self._lost is not None:
            raise self._lost
        for rank, (conn, args) in enumerate(zip(self._conns, args_per_rank)):
            try:
                conn.send((method, model_id, tuple(args)))
            except OSError:
                self._lose(rank, self._ranks[rank].exitcode)
        replies = [self._receive(rank) for rank in range(self.world)]
        errors = [value for status, value in replies if status == "error"]
        if errors:
            raise errors[0]
        return [value for _, value in replies]

    def _receive(self, rank: int, timeout: Optional[float] = None):
        """Rank `rank`'s reply; a dead rank (its process gone) is fatal to the whole group."""
        conn, process = self._conns[rank], self._ranks[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not conn.poll(0.2):
            if not process.is_alive() or (deadline is not None and time.monotonic() > deadline):
                self._lose(rank, process.exitcode)
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._lose(rank, process.exitcode)

    def _watch(self) -> None:
        while not self._closing.wait(0.5) and self._lost is None:
            for rank, process in enumerate(self._ranks):
                if not process.is_alive() and not self._closing.is_set():
                    try:
                        self._lose(rank, process.exitcode)
                    except RankLost:
                        return

    def _lose(self, rank: int, exitcode: Optional[int]) -> None:
        """Kill the other ranks (they would wait in a collective for the dead one) and tell
        `on_rank_lost`, once; every later call raises the same error."""
        with self._losing:
            if self._lost is None:
                for process in self._ranks:
                    if process.is_alive():
                        process.kill()
                self._lost = RankLost(f"FSDP rank {rank} of {self.world} is gone (exit code {exitcode})")
                self._on_rank_lost(self._lost)
        raise self._lost


def _parameter_shapes(files: ModelFiles) -> dict[str, tuple[int, ...]]:
    """The base model's parameter names and shapes (tied weights once), without its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(files.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
