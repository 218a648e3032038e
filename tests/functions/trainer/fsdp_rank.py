"""One rank of the gloo FSDP test (test_fsdp_gloo.py runs it as a subprocess per rank).

    python -m tests.functions.trainer.fsdp_rank RANK WORLD PORT OUT_DIR MODE

MODE `train`: STEPS steps, a distributed checkpoint after step CHECKPOINT_AT, results (rank
0) to OUT_DIR/train.pt. `die`: the same, but rank 1 kills itself with SIGKILL right after
the checkpoint (the other rank is left blocked in a collective; the test kills it).
`resume`: load the checkpoint and replay the steps after it, results to OUT_DIR/resume.pt.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import torch

from functions.compute.models import materialize
from functions.compute.weight_sync import Publisher
from functions.trainer.fsdp import ShardedFullRun, init_process_group
from openrl_core.catalog import BUILTIN, TINY_QWEN3
from openrl_core.events.lifecycle import BlobRef
from openrl_core.params import AdamParams
from tests.functions.trainer.conftest import sft_batch

STEPS, CHECKPOINT_AT = 3, 2
LENGTHS = [5, 17, 33]  # three datums over two ranks: rank 0 gets two, rank 1 one
HP = AdamParams(learning_rate=1e-4, grad_clip_norm=50.0, weight_decay=0.01)


def put(root: Path, data: bytes) -> BlobRef:
    digest = hashlib.sha256(data).hexdigest()
    (root / digest).write_bytes(data)
    return BlobRef(sha256=digest, size=len(data))


def main(rank: int, world: int, port: int, out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port)
    run = ShardedFullRun(materialize(BUILTIN[TINY_QWEN3]))
    first = 0
    if mode == "resume":
        run.load(out / "checkpoint")
        first = CHECKPOINT_AT
    losses, norms, logprobs, publications = [], [], [], []
    blobs = out / f"blobs-{mode}"
    blobs.mkdir(exist_ok=True)
    publisher = Publisher("run", TINY_QWEN3, "bfloat16", full_every=0)
    for step in range(first, STEPS):
        result = run.forward_backward(sft_batch(step, LENGTHS), "cross_entropy", None)
        losses.append(result.metrics["loss:sum"])
        logprobs.append([torch.from_numpy(x) for x in result.logprobs])
        norms.append(run.optim_step(HP)["optim/grad_norm"])
        publication = run.publish(publisher, step + 1, lambda data: put(blobs, data))
        if rank == 0:
            publications.append((publication.kind, publication.manifest.sha256, publication.changed))
        if step + 1 == CHECKPOINT_AT and mode != "resume":
            run.save(out / "checkpoint")
            if mode == "die" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    weights = run.gathered_weights()
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "norms": norms,
                "logprobs": logprobs,
                "weights": weights,
                "local_bytes": run.local_bytes(),
                "publications": publications,
            },
            out / f"{mode}.pt",
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
