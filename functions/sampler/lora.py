"""The torch sampler's LoRA adapters: plain tensors beside an unmodified base, applied per row run.

`LoraAdapters(model, model_name)` indexes the base model's Linear layers once. `load(key,
files)` reads an adapter's PEFT files (`adapter_model.safetensors` with keys
`base_model.model.<module path>.lora_{A,B}.weight`, and `adapter_config.json`: what the
trainer exports and `peft.save_pretrained` writes) straight into tensors. `applied(rows)` is a
context for one forward pass in which every Linear layer some row's adapter targets adds, to
each contiguous run of rows that share an adapter, that adapter's update
`x @ (scaling * A)^T @ B^T` to the base layer's output.

Why not peft: peft injects a LoRA module into every targeted layer at each load (walking the
whole model, building layers and initialising weights it then overwrites, so a load cost more
the more adapters were loaded), and its mixed-adapter batch gathers and scatters each
adapter's rows by index in every layer. Rows of one adapter are contiguous here (the engine
orders them so), so a run is a slice of the layer's input and output.

Invariants:
- The base model is never modified: its weights are never written (they may be the process's
  shared frozen copy, `functions.compute.shared_weights`), and outside `applied` it carries no
  hook of ours, so a pass with no adapter row is the plain Hugging Face model.
- A row with no adapter, and a layer an adapter does not target, get exactly the base output.
- Loading costs the adapter's own size: nothing depends on how many adapters are loaded.
  Every check runs before anything is kept, so a bad adapter leaves the others as they were.
- `scaling` (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into A once, at load; for a
  half-precision base the adapter is kept and applied in float32 (as peft does by default).
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from openrl_core.errors import InvalidRequest

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
KEY = re.compile(r"base_model\.model\.(?P<path>.+)\.lora_(?P<half>[AB])\.weight")
ALL_LINEAR = "all-linear"  # peft's shorthand: every Linear layer but the output layer
# Config fields naming peft features this engine does not apply; an adapter using one is
# refused rather than served wrong. Each is off when absent, null, false, empty or "none".
UNSUPPORTED = (
    "use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "layers_pattern",
    "lora_bias", "trainable_token_indices", "alora_invocation_tokens", "use_qalora", "layer_replication",
    "target_parameters", "use_bdlora", "arrow_config", "kasa_config", "monteclora_config",
)  # fmt: skip


@dataclass(frozen=True)
class LayerLora:
    """One layer's update: output += x @ down_R_I^T @ up_O_R^T (down already scaled)."""

    down_R_I: torch.Tensor
    up_O_R: torch.Tensor
    # The transposes the hook multiplies by, as views made once: the hook runs for every
    # targeted layer, adapter run and decoding step, where two `.t()` calls each added up.
    down_I_R: torch.Tensor = field(init=False, repr=False)
    up_R_O: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "down_I_R", self.down_R_I.t())
        object.__setattr__(self, "up_R_O", self.up_O_R.t())


class LoraAdapters:
    """The adapters loaded beside one base model, by the caller's key."""

    def __init__(self, model: torch.nn.Module, model_name: str) -> None:
        self.model_name = model_name
        self._linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._output = model.get_output_embeddings()
        self._adapters: dict[str, dict[str, LayerLora]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def drop(self, key: str) -> None:
        """Forget an adapter; an unknown key is ignored, so eviction can be retried."""
        self._adapters.pop(key, None)

    def load(self, key: str, files: Mapping[str, bytes]) -> None:
        """Read an adapter from its files (replacing one of the same key), or InvalidRequest."""
        rank, scaling, targets = self._config(key, files[CONFIG_FILE])
        halves = self._weights(key, files[WEIGHTS_FILE])
        missing = sorted(f"base_model.model.{path}.lora_{half}.weight" for path in targets for half in "AB"
                         if (path, half) not in halves)  # fmt: skip
        unexpected = sorted(
            f"base_model.model.{path}.lora_{half}.weight" for path, half in halves if path not in targets
        )
        if missing or unexpected:
            # Keys that match no layer would otherwise load as a silent no-op.
            raise InvalidRequest(
                f"adapter {key!r} does not fit {self.model_name}: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        layers = {}
        for path in sorted(targets):
            linear = self._linears[path]
            down, up = halves[(path, "A")], halves[(path, "B")]
            for name, tensor, shape in (
                ("A", down, (rank, linear.in_features)),
                ("B", up, (linear.out_features, rank)),
            ):
                if tuple(tensor.shape) != shape:
                    raise InvalidRequest(
                        f"adapter {key!r} does not fit {self.model_name}: base_model.model.{path}.lora_{name}.weight "
                        f"has shape {list(tensor.shape)}, expected {list(shape)} (r={rank})"
                    )
            weight = linear.weight
            dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
            # Own storage: the file's tensors are views into its bytes, which they would keep
            # alive, at whatever alignment the bytes had (MKL's results can depend on it).
            down = down.to(device=weight.device, dtype=dtype, copy=True).mul_(scaling)
            layers[path] = LayerLora(down, up.to(device=weight.device, dtype=dtype, copy=True))
        self._adapters[key] = layers

    @contextmanager
    def applied(self, row_keys: list[Optional[str]]) -> Iterator[None]:
        """For one forward pass: row i uses the adapter `row_keys[i]` (None: the base alone)."""
        runs = row_runs(row_keys)
        per_layer: dict[str, list[tuple[int, int, LayerLora]]] = {}
        for start, stop, key in runs:
            for path, lora in self._adapters[key].items():
                per_layer.setdefault(path, []).append((start, stop, lora))
        with ExitStack() as stack:
            for path, parts in per_layer.items():
                handle = self._linears[path].register_forward_hook(_hook(parts, len(row_keys), path))
                stack.callback(handle.remove)
            yield

    def _config(self, key: str, raw: bytes) -> tuple[int, float, set[str]]:
        """Rank, scaling and the paths of the Linear layers the config targets."""
        try:
            config = json.loads(raw)
            if not isinstance(config, dict):
                raise ValueError("it must hold a JSON object")
            if "peft_type" not in config:
                raise KeyError("peft_type")
            rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)  # peft's defaults
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise ValueError(f"r must be a positive integer, got {rank!r}")
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
                raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"adapter {key!r} has an unreadable adapter_config.json: {exc}") from exc
        if config["peft_type"] != "LORA":
            raise InvalidRequest(f"adapter {key!r} is {config['peft_type']}, only LoRA is supported")
        used = [name for name in UNSUPPORTED if config.get(name) not in (None, False, [], {}, "", "none")]
        if config.get("bias", "none") != "none":
            used.append("bias")
        if used:
            raise InvalidRequest(f"adapter {key!r} uses {', '.join(used)}, which this sampler does not apply")
        targets = {path for path, linear in self._linears.items() if self._targeted(config, path, linear)}
        if not targets:
            raise InvalidRequest(
                f"adapter {key!r} does not fit {self.model_name}: its target_modules "
                f"{config.get('target_modules')!r} match no Linear layer"
            )
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        return rank, scaling, targets

    def _targeted(self, config: dict, path: str, linear: torch.nn.Module) -> bool:
        """peft's rule: a regex must match the whole path; a name list matches a path's tail."""
        if _matches(config.get("exclude_modules"), path):
            return False
        targets = config.get("target_modules")
        if targets == ALL_LINEAR:
            return linear is not self._output
        return _matches(targets, path)

    def _weights(self, key: str, raw: bytes) -> dict[tuple[str, str], torch.Tensor]:
        """The file's tensors by (layer path, "A" or "B"); other keys go under their own name."""
        try:
            tensors = load_safetensors(raw)
        except (ValueError, RuntimeError, SafetensorError) as exc:
            raise InvalidRequest(f"adapter {key!r} has an unreadable adapter_model.safetensors: {exc}") from exc
        halves = {}
        for name, tensor in tensors.items():
            match = KEY.fullmatch(name)
            if match is None or not tensor.is_floating_point():
                raise InvalidRequest(f"adapter {key!r} does not fit {self.model_name}: unexpected {[name]}")
            halves[(match["path"], match["half"])] = tensor
        return halves


def row_runs(row_keys: list[Optional[str]]) -> list[tuple[int, int, str]]:
    """Maximal runs [start, stop) of consecutive rows sharing one adapter, base rows left out."""
    runs: list[tuple[int, int, str]] = []
    for row, key in enumerate(row_keys):
        if key is None:
            continue
        if runs and runs[-1][1] == row and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], row + 1, key)
        else:
            runs.append((row, row + 1, key))
    return runs


def _matches(pattern, path: str) -> bool:
    if pattern is None:
        return False
    if isinstance(pattern, str):
        return re.fullmatch(pattern, path) is not None
    return any(path == name or path.endswith("." + name) for name in pattern)


def _hook(parts: list[tuple[int, int, LayerLora]], rows: int, path: str):
    def add_updates(_module, args, output):
        x = args[0]
        if x.shape[0] != rows or output.shape[0] != rows:
            # Every target layer of a causal LM sees the batch's rows first; a model that
            # reshapes them away would get updates on the wrong rows.
            raise RuntimeError(f"{path}: input of {x.shape[0]} rows in a pass of {rows}")
        width, out_width = x.shape[-1], output.shape[-1]
        for start, stop, lora in parts:
            out_part = output[start:stop]
            x_N_I = x[start:stop].reshape(-1, width)
            if x_N_I.dtype != lora.down_I_R.dtype:
                x_N_I = x_N_I.to(lora.down_I_R.dtype)
            down_N_R = x_N_I @ lora.down_I_R
            if out_part.dtype == lora.up_R_O.dtype and out_part.is_contiguous():
                out_part.view(-1, out_width).addmm_(down_N_R, lora.up_R_O)
            else:
                out_part.add_((down_N_R @ lora.up_R_O).view(out_part.shape))
        return None  # the output was updated in place

    return add_updates
