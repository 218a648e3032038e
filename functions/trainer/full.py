"""Full fine-tuning: each run its own float32 copy of the model, its gradients and AdamW state.

`FullFinetuneEngine` holds the full runs of one base model and answers the same calls as
the LoRA engine (forward_backward, optim_step, export/copy/import state, park/restore), so
the worker drives both alike. Invariants:
- A run starts as a copy of the base weights in float32 (master weights; with a bf16
  `precision` the forward runs under bf16 autocast, the weights stay float32), every parameter
  trainable (tied embeddings stay tied: one parameter, named once), the model in eval mode
  (no dropout), so a run is deterministic on CPU and bitwise the same steps done with plain
  torch (`transformers` forward, `torch.optim.AdamW`).
- Gradients accumulate across forward_backward calls until optim_step applies and clears
  them; runs share nothing.
- State files: `model.safetensors` (float32, parameter names as in `named_parameters`),
  `openrl_full.json` (the marker that says a checkpoint is a full run's, and of which base)
  and the optimizer files of `optimizer.py`; a sharded run's checkpoint (`full_files.py`)
  loads here too. `export_external` writes what
  `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.
- Sampler weights are published through `weight_sync.Publisher` (full or sparse delta).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from functions.compute import parking
from functions.compute.models import ModelFiles, load_causal_lm, parameter_count
from functions.compute.weight_sync import Publication, Publisher, Put
from functions.trainer import batching, full_files, optimizer, passes, tensor_files
from functions.trainer.full_files import MARKER_FILE, WEIGHTS_FILE
from functions.trainer.passes import DEFAULT_MAX_PADDED_TOKENS, ForwardBackwardResult
from functions.trainer.precision import Precision
from openrl_core import memory
from openrl_core.datum import Datum, validate_batch
from openrl_core.errors import Conflict, InvalidRequest, NotFound
from openrl_core.losses import resolve_config
from openrl_core.params import AdamParams

MARKER_FORMAT = "openrl.full.v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")  # fmt: skip


def is_full_state(files: Mapping[str, bytes]) -> bool:
    return MARKER_FILE in files


@dataclass
class _Run:
    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    adam: optimizer.AdamState
    publisher: Publisher
    numel: int = 0  # elements of the weights, counted at creation (parking empties them)
    parked: Optional[parking.Parked] = None


class FullFinetuneEngine:
    def __init__(
        self,
        files: ModelFiles,
        device: str = "cpu",
        max_padded_tokens: int = DEFAULT_MAX_PADDED_TOKENS,
        max_padding: float = batching.MAX_PADDING,
        serving_dtype: str = "bfloat16",
        full_every: int = 20,
        max_share: float = 0.5,
        precision: Precision = Precision(),
    ) -> None:
        self._files = files
        self.precision = precision
        self._device = torch.device(device)
        self._max_padded_tokens = max_padded_tokens
        self._max_padding = max_padding
        self._serving = (serving_dtype, full_every, max_share)
        self._runs: dict[str, _Run] = {}

    # -- runs ------------------------------------------------------------------------------

    def state_bytes_estimate(self) -> int:
        return memory.full_state_bytes(parameter_count(self._files))

    def create(self, model_id: str) -> None:
        if model_id in self._runs:
            raise Conflict(f"model {model_id!r} already exists")
        model = load_causal_lm(self._files, dtype=self.precision.master_dtype, device=str(self._device))
        self.precision.prepare(model)
        model.eval()  # no dropout: a step is a deterministic function of weights and data
        model.requires_grad_(True)
        params = dict(model.named_parameters())  # tied weights appear once
        dtype, full_every, max_share = self._serving
        self._runs[model_id] = _Run(
            model,
            params,
            optimizer.fresh_state(params),
            Publisher(model_id, self._files.name, dtype, full_every, max_share),
            numel=sum(p.numel() for p in params.values()),
        )

    def has(self, model_id: str) -> bool:
        return model_id in self._runs

    def drop(self, model_id: str) -> None:
        self._runs.pop(model_id, None)

    # -- training --------------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        batch: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult:
        run = self._require(model_id)
        config = resolve_config(loss_fn, loss_fn_config)
        validate_batch(batch, loss_fn, self._files.vocab_size)
        decoder, lm_head = run.model.get_decoder(), run.model.get_output_embeddings()
        return passes.run(
            decoder,
            lm_head,
            batch,
            loss_fn,
            config,
            forward_only,
            self._device,
            self._max_padded_tokens,
            self._max_padding,
            autocast=lambda: self.precision.autocast(self._device),
        )

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        run = self._require(model_id)
        grad_norm = optimizer.adamw_step(run.params, run.adam, params)
        for p in run.params.values():
            p.grad = None
        return {"optim/grad_norm": grad_norm, "optim/lr": float(params.learning_rate)}

    # -- checkpoints -----------------------------------------------------------------------

    def export_state(self, model_id: str) -> dict[str, bytes]:
        return self.copy_state(model_id)()

    def copy_state(self, model_id: str) -> Callable[[], dict[str, bytes]]:
        """Copy weights and optimizer now (on the training thread); encode later, anywhere."""
        run = self._require(model_id)
        weights = {key: p.detach().to("cpu", copy=True) for key, p in run.params.items()}
        adam = optimizer.AdamState(
            step=run.adam.step,
            exp_avg={k: t.to("cpu", copy=True) for k, t in run.adam.exp_avg.items()},
            exp_avg_sq={k: t.to("cpu", copy=True) for k, t in run.adam.exp_avg_sq.items()},
        )
        marker = json.dumps({"format": MARKER_FORMAT, "base_model": self._files.name}, sort_keys=True).encode()
        return lambda: {WEIGHTS_FILE: tensor_files.save(weights), MARKER_FILE: marker, **optimizer.state_to_files(adam)}

    def import_state(self, model_id: str, files: Mapping[str, bytes], with_optimizer: bool) -> None:
        """Load a full run's files into `model_id` (created from the base if missing); every
        check comes before any write, so a bad checkpoint leaves the run as it was."""
        if not is_full_state(files):
            raise InvalidRequest("this is a LoRA checkpoint; the run trains every weight (full fine-tuning)")
        files = full_files.whole(files)  # a sharded run's checkpoint (sharded.py) reads as a whole one
        tensors = tensor_files.read(files, WEIGHTS_FILE)
        created = model_id not in self._runs
        if created:
            self.create(model_id)
        run = self._runs[model_id]
        try:
            tensor_files.check_fit(tensors, run.params, WEIGHTS_FILE, self._files.name)
            adam = (
                optimizer.state_from_files(files, run.params) if with_optimizer else optimizer.fresh_state(run.params)
            )
        except InvalidRequest:
            if created:
                self.drop(model_id)
            raise
        tensor_files.copy_into(run.params, tensors)
        for p in run.params.values():
            p.grad = None
        run.adam = adam

    def export_external(self, model_id: str) -> dict[str, bytes]:
        """A Hugging Face model directory's files: config, float32 weights, tokenizer."""
        run = self._require(model_id)
        with tempfile.TemporaryDirectory(prefix="openrl-full-") as tmp:
            run.model.save_pretrained(tmp, safe_serialization=True)
            out = {path.name: path.read_bytes() for path in Path(tmp).iterdir() if path.is_file()}
        for name in TOKENIZER_FILES:
            source = Path(self._files.path) / name
            if source.exists() and name not in out:
                out[name] = source.read_bytes()
        return out

    def publish(self, model_id: str, version: int, put: Put) -> Publication:
        run = self._require(model_id)
        return run.publisher.publish(run.params, version, put)

    # -- parking ---------------------------------------------------------------------------

    def state_bytes(self, model_id: str) -> int:
        return memory.full_state_bytes(self._require(model_id).numel)

    def park(self, model_id: str) -> tuple[float, int]:
        run = self._require(model_id)
        return parking.park_once(run, optimizer.training_slots(run.params, run.adam))

    def restore(self, model_id: str) -> tuple[float, int]:
        run = self._require(model_id)
        return parking.restore_once(run, optimizer.training_slots(run.params, run.adam))

    def is_parked(self, model_id: str) -> bool:
        return self._require(model_id).parked is not None

    # -- introspection (tests) -----------------------------------------------------------

    def weights(self, model_id: str) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self._require(model_id).params.items()}

    def adam_state(self, model_id: str) -> optimizer.AdamState:
        return self._require(model_id).adam

    # -- internals -------------------------------------------------------------------------

    def _require(self, model_id: str) -> _Run:
        run = self._runs.get(model_id)
        if run is None:
            raise NotFound(f"model {model_id!r} is not loaded on this trainer")
        return run
