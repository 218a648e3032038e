"""The trainer's compute engine: many LoRA adapters on one frozen base model, driven by calls.

The engine knows nothing about events, queues or storage: it is called with a model id and
token ids and answers with numbers and files. Invariants:
- The base model is loaded once, in the precision's base dtype (float32; bf16 by default on
  CUDA, see `precision.py`), frozen, in eval mode (no dropout); each adapter (float32 always)
  (one per model id, each with its own rank and optimizer state) is a PEFT adapter on it.
  Its tensors come from `shared_weights`: a sampler in the same process serves the same
  storage, so the base is never written (parking moves adapters only).
- `forward_backward_many` runs several models' requests in shared passes, each row with its
  own adapter (`packed`), and each model's numbers are bitwise those of its request alone;
  `forward_backward` is the same path with one request.
- Gradients accumulate in the adapter's own parameters across `forward_backward` calls until
  `optim_step` applies and clears them; adapters share no parameters, so they never mix.
- Everything is deterministic on CPU: the same sequence of calls gives bitwise the same
  weights (seeded initialisation, fixed reduction order, no sampling).
- Bad calls raise `openrl_core.errors` types (NotFound, Conflict, InvalidRequest).

`optim_step` returns {"optim/grad_norm": global L2 norm of the adapter's accumulated gradient
before clipping, "optim/lr": the learning rate applied}. tinker-cookbook merges optim_step
metrics as-is into its step log, whose optimizer keys already live under "optim/" (e.g.
"optim/lr", "optim/kl_sample_train_v1"), so these names group with them and collide with no
key of its own. No ':' in them: that suffix means a reduction only in forward_backward metrics.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from functions.compute import parking
from functions.compute.models import ModelFiles
from functions.compute.shared_weights import load_frozen
from functions.trainer import adapters, optimizer, packed
from functions.trainer.passes import DEFAULT_MAX_PADDED_TOKENS, ForwardBackwardResult
from functions.trainer.precision import Precision
from openrl_core import memory, packing
from openrl_core.datum import Datum, validate_batch
from openrl_core.errors import Conflict, InvalidRequest, NotFound, OpenRLError, ServerError
from openrl_core.losses import resolve_config
from openrl_core.params import AdamParams, DimuonParams, LoraConfig

__all__ = ["TrainerEngine", "PackRequest", "ForwardBackwardResult", "DEFAULT_MAX_PADDED_TOKENS"]


@dataclass(frozen=True)
class PackRequest:
    model_id: str
    batch: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool


@dataclass
class _Adapter:
    name: str  # the internal PEFT adapter name
    lora: LoraConfig
    params: dict[str, torch.nn.Parameter]  # PEFT file key -> parameter
    adam: "optimizer.AdamState | optimizer.DimuonState"  # either family's state (optimizer.py)
    numel: int = 0  # elements of the adapter, counted at creation (parking empties them)
    parked: Optional[parking.Parked] = None


# Saved activations per decoder layer and token, in units of the hidden size (float32), that
# a backward keeps: norms, q/k/v/o inputs and outputs, attention probabilities' share, and the
# MLP's wider intermediates (about 3x hidden each). An estimate for ranking pass sizes.
ACTIVATIONS_PER_LAYER = 24
DEFAULT_SHARED_PASS_BYTES = 1 << 30


def token_bytes(config) -> int:
    """Bytes one padded token costs a pass: its float32 logits row over the vocabulary (and
    its log-softmax) plus the decoder activations kept for the backward."""
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    return 4 * (2 * int(config.vocab_size) + ACTIVATIONS_PER_LAYER * hidden * layers)


class TrainerEngine:
    def __init__(
        self,
        files: ModelFiles,
        device: str = "cpu",
        max_padded_tokens: int = DEFAULT_MAX_PADDED_TOKENS,
        max_rows: int = 256,
        max_shared_pass_bytes: int = DEFAULT_SHARED_PASS_BYTES,
        precision: Precision = Precision(),
    ):
        """Load the base model once; the limits bound one pass (see openrl_core.packing): a pass
        shared by several models also stays within `max_shared_pass_bytes` of estimated
        activations (`token_bytes`)."""
        self._files = files
        self._device = torch.device(device)
        self._max_padded_tokens = max_padded_tokens
        self._max_rows = max_rows
        self.precision = precision
        base = precision.prepare(load_frozen(files, dtype=precision.base_dtype, device=device))
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        rescales = getattr(config, "logit_scale", None) not in (None, 1, 1.0)
        if getattr(config, "final_logit_softcapping", None) or rescales:
            # logprobs are computed as lm_head(decoder(x)); a model that rescales logits after
            # lm_head would get wrong logprobs silently.
            raise ServerError(f"{files.name}: models that rescale logits after lm_head are not supported")
        self._base = base
        self.limits = packing.Limits(
            max_padded_tokens, max_rows, max(packing.PAD_MULTIPLE, max_shared_pass_bytes // token_bytes(config))
        )
        self._peft = None  # the PeftModel, created with the first adapter
        self._adapters: dict[str, _Adapter] = {}

    # -- adapters -------------------------------------------------------------------------

    def create_adapter(self, model_id: str, lora: LoraConfig, optimizer_family: str = "adamw") -> None:
        """A fresh adapter (B = 0, so the model is unchanged) with its own optimizer state, of
        `optimizer_family` ("adamw" or "dimuon")."""
        if model_id in self._adapters:
            raise Conflict(f"model {model_id!r} already has an adapter")
        name = adapters.internal_name(model_id)
        config = adapters.peft_config(lora)
        # PEFT draws its own initial weights from the global RNG; fork it so the engine leaves
        # no trace there (our seeded initialisation below overwrites those weights anyway).
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # Tied-embedding models (tiny Qwen3) warn that lm_head is tied; the LoRA on lm_head
            # is meant to act on the output projection only, which is what PEFT does.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            try:
                if self._peft is None:
                    from peft import get_peft_model

                    self._peft = get_peft_model(self._base, config, adapter_name=name)
                else:
                    self._peft.add_adapter(name, config)
            except ValueError as error:
                raise InvalidRequest(f"cannot put this LoRA on {self._files.name}: {error}") from error
        # Eval mode: no dropout anywhere (LoRA dropout is 0 too), and PEFT takes per-row
        # adapter names only in eval mode; gradients flow all the same.
        self._peft.eval()
        params = adapters.adapter_parameters(self._peft, name)
        adapters.initialize(params, adapters.init_seed(model_id, lora))
        numel = sum(p.numel() for p in params.values())
        self._adapters[model_id] = _Adapter(name, lora, params, optimizer.fresh_state(params, optimizer_family), numel)

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self._adapters

    def drop_adapter(self, model_id: str) -> None:
        adapter = self._require(model_id)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
            self._peft.delete_adapter(adapter.name)
        del self._adapters[model_id]

    def lora_config_of(self, files: Mapping[str, bytes]) -> LoraConfig:
        return adapters.lora_config_of(files)

    # -- device memory: what a timeslicer needs to know, and parking -----------------------

    def base_bytes(self) -> int:
        """The frozen base weights, shared by every adapter and never parked."""
        return parking.nbytes(p for name, p in self._base.named_parameters() if "lora_" not in name)

    def adapter_bytes_estimate(self, lora: LoraConfig) -> int:
        """An adapter's resident bytes before it exists: weights, gradients, Adam's two moments."""
        wanted = set(adapters.target_modules(lora))
        elements = 0
        for name, module in self._base.named_modules():
            if name.rsplit(".", 1)[-1] in wanted and hasattr(module, "in_features"):
                elements += lora.rank * (module.in_features + module.out_features)
        return memory.lora_state_bytes(elements)

    def state_bytes(self, model_id: str) -> int:
        return memory.lora_state_bytes(self._require(model_id).numel)

    def park(self, model_id: str) -> tuple[float, int]:
        """Move the adapter, its gradients and its optimizer state to host memory."""
        adapter = self._require(model_id)
        return parking.park_once(adapter, optimizer.training_slots(adapter.params, adapter.adam))

    def restore(self, model_id: str) -> tuple[float, int]:
        adapter = self._require(model_id)
        return parking.restore_once(adapter, optimizer.training_slots(adapter.params, adapter.adam))

    def is_parked(self, model_id: str) -> bool:
        return self._require(model_id).parked is not None

    # -- training -------------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        batch: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult:
        """Per-datum target logprobs and the summed loss; unless forward_only, add its gradient."""
        result = self.forward_backward_many([PackRequest(model_id, batch, loss_fn, loss_fn_config, forward_only)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def forward_backward_many(self, requests: list["PackRequest"]) -> list:
        """Several models' requests in shared passes (`packed`), each bitwise as if it ran
        alone; per request its result or the error it alone raised (checked up front)."""
        out: list = [None] * len(requests)
        checked, indices = [], []
        for index, request in enumerate(requests):
            try:
                adapter = self._require(request.model_id)
                config = resolve_config(request.loss_fn, request.loss_fn_config)
                validate_batch(request.batch, request.loss_fn, self._files.vocab_size)
            except OpenRLError as error:
                out[index] = error
                continue
            checked.append(packed.Request(adapter.name, request.batch, request.loss_fn, config, request.forward_only))
            indices.append(index)
        if checked:
            params = {a.name: a.params for a in self._adapters.values() if a.name in {r.adapter for r in checked}}
            results = packed.run(self._peft, checked, params, self.limits, self._device)
            for index, result in zip(indices, results):
                out[index] = result
        return out

    def optim_step(self, model_id: str, params: "AdamParams | DimuonParams") -> dict[str, float]:
        """Apply the accumulated gradient with the adapter's optimizer (AdamW, optimizer.py, or
        Dimuon, dimuon.py) and clear it."""
        adapter = self._require(model_id)
        grad_norm = optimizer.step(adapter.params, adapter.adam, params)
        self._clear_gradients(adapter)
        return {"optim/grad_norm": grad_norm, "optim/lr": float(params.learning_rate)}

    # -- checkpoints ----------------------------------------------------------------------

    def export_adapter(self, model_id: str) -> dict[str, bytes]:
        adapter = self._require(model_id)
        return adapters.export_files(adapter.params, adapter.lora, self._files.name)

    def export_state(self, model_id: str) -> dict[str, bytes]:
        """Adapter files plus optimizer state; gradients accumulated since the last step are not saved."""
        return self.copy_state(model_id)()

    def copy_state(self, model_id: str) -> Callable[[], dict[str, bytes]]:
        """Copy the adapter and its optimizer state now; serialise later, on any thread.

        Snapshots take only the copy on the training thread, so they hold training up no
        longer than a memcpy of the adapter; encoding and writing happen in the background.
        """
        adapter = self._require(model_id)
        params = {key: p.detach().clone() for key, p in adapter.params.items()}
        adam = optimizer.clone_state(adapter.adam)
        lora, name = adapter.lora, self._files.name
        return lambda: {**adapters.export_files(params, lora, name), **optimizer.state_to_files(adam)}

    def import_state(self, model_id: str, files: Mapping[str, bytes], with_optimizer: bool) -> None:
        """Load exported files; creates the adapter from their adapter_config.json if it is missing.

        An existing adapter must have the files' rank and modules (Conflict otherwise). Without
        the optimizer the moments restart from zero; either way pending gradients are dropped.
        """
        lora = adapters.lora_config_of(files)
        created = model_id not in self._adapters
        if created:
            self.create_adapter(model_id, lora)
        adapter = self._adapters[model_id]
        if adapters.target_modules(adapter.lora) != adapters.target_modules(lora) or adapter.lora.rank != lora.rank:
            raise Conflict(f"model {model_id!r} has a rank-{adapter.lora.rank} adapter; this checkpoint doesn't fit it")
        try:
            # Both checks come before any write, so a bad checkpoint leaves the adapter as it was.
            if with_optimizer:
                adam = optimizer.state_from_files(files, adapter.params)
            else:
                adam = optimizer.fresh_state(adapter.params, optimizer.family_of(adapter.adam))
            adapters.load_weights(adapter.params, files)
        except InvalidRequest:
            if created:
                self.drop_adapter(model_id)
            raise
        adapter.adam = adam
        self._clear_gradients(adapter)

    # -- introspection (tests, debugging) ------------------------------------------------

    def adapter_weights(self, model_id: str) -> dict[str, np.ndarray]:
        adapter = self._require(model_id)
        return {key: p.detach().cpu().numpy().copy() for key, p in adapter.params.items()}

    def adapter_gradients(self, model_id: str) -> dict[str, np.ndarray]:
        """Accumulated gradients (zeros where none arrived yet)."""
        adapter = self._require(model_id)
        return {
            key: (p.grad.detach().cpu().numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
            for key, p in adapter.params.items()
        }

    # -- internals ------------------------------------------------------------------------

    def _require(self, model_id: str) -> _Adapter:
        adapter = self._adapters.get(model_id)
        if adapter is None:
            raise NotFound(f"model {model_id!r} has no adapter on this trainer")
        return adapter

    @staticmethod
    def _clear_gradients(adapter: _Adapter) -> None:
        for p in adapter.params.values():
            p.grad = None
