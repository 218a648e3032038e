"""How a Tinker `LoraConfig` becomes a PEFT adapter, and how an adapter becomes files.

Invariants:
- Target modules: attn -> q/k/v/o_proj, mlp -> gate/up/down_proj, unembed -> lm_head (the
  Hugging Face names of Llama/Qwen-family models).
- `lora_alpha` is 32 whatever the rank, so the update is scaled by 32/rank. That is Tinker's
  choice ("LoRA Without Regret": fixed alpha=32 with 1/r scaling, which makes the best
  learning rate independent of the rank; tinker-cookbook's `get_lora_lr_over_full_finetune_lr`
  assumes lora_alpha=32), and tinker-cookbook's merge reads `lora_alpha / r` back from
  adapter_config.json, so the files say it explicitly.
- Initialisation is PEFT's default distribution (A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
  B = 0, so a fresh adapter leaves the model unchanged) drawn from a private generator seeded
  by `lora.seed`, or by a hash of the model id when no seed is given: the same calls always
  give bitwise the same adapter, and the process-wide RNG is never touched.
- Exported files are plain PEFT: `adapter_model.safetensors` with keys
  `base_model.model.<module path>.lora_{A,B}.weight` and `adapter_config.json`, loadable by
  `peft.PeftModel.from_pretrained`. Inside the shared PEFT model an adapter lives under a
  safe internal name (model ids may hold ':' or '.', which module dicts refuse).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Mapping

import torch

from functions.trainer import tensor_files
from openrl_core.errors import InvalidRequest
from openrl_core.params import MAX_LORA_RANK, LoraConfig

LORA_ALPHA = 32
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def internal_name(model_id: str) -> str:
    """A name PEFT accepts as a module-dict key, stable for a given model id."""
    return "openrl_" + hashlib.sha256(model_id.encode()).hexdigest()[:24]


def target_modules(lora: LoraConfig) -> list[str]:
    modules: list[str] = []
    if lora.train_attn:
        modules += ATTN_MODULES
    if lora.train_mlp:
        modules += MLP_MODULES
    if lora.train_unembed:
        modules += UNEMBED_MODULES
    return sorted(modules)


def peft_config(lora: LoraConfig, base_model_name: str | None = None):
    """The PEFT config; `base_model_name` only labels exported files (PEFT loads no base from it)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        bias="none",
        target_modules=target_modules(lora),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name,
    )


def adapter_parameters(peft_model: torch.nn.Module, name: str) -> dict[str, torch.nn.Parameter]:
    """The adapter's LoRA parameters keyed by their PEFT file key, in sorted order."""
    marker_a, marker_b = f".lora_A.{name}.", f".lora_B.{name}."
    params = {}
    for param_name, param in peft_model.named_parameters():
        if marker_a in param_name or marker_b in param_name:
            params[param_name.replace(f".{name}.", ".")] = param
    return dict(sorted(params.items()))


def init_seed(model_id: str, lora: LoraConfig) -> int:
    if lora.seed is not None:
        return int(lora.seed)
    return int.from_bytes(hashlib.sha256(b"openrl-lora-init:" + model_id.encode()).digest()[:8], "little")


@torch.no_grad()
def initialize(params: Mapping[str, torch.nn.Parameter], seed: int) -> None:
    """A from PEFT's kaiming-uniform(a=sqrt(5)) distribution, B zero; draws in sorted key order on CPU."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed % (2**63))
    for key in sorted(params):
        param = params[key]
        if ".lora_B." in key:
            param.zero_()
            continue
        fan_in = param.shape[1]
        bound = 1.0 / math.sqrt(fan_in)
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        param.copy_(values.to(param.dtype))


def export_files(params: Mapping[str, torch.nn.Parameter], lora: LoraConfig, base_model_name: str) -> dict[str, bytes]:
    tensors = {key: param.detach().cpu().contiguous() for key, param in params.items()}
    config = peft_config(lora, base_model_name).to_dict()
    config = {key: (sorted(value) if isinstance(value, (set, frozenset)) else value) for key, value in config.items()}
    return {
        WEIGHTS_FILE: tensor_files.save(tensors),
        CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True, default=str).encode(),
    }


def lora_config_of(files: Mapping[str, bytes]) -> LoraConfig:
    """Read rank and trained module groups back from an adapter_config.json (seed is not kept)."""
    if CONFIG_FILE not in files:
        raise InvalidRequest(f"the checkpoint has no {CONFIG_FILE}")
    try:
        config = json.loads(files[CONFIG_FILE])
    except ValueError as error:
        raise InvalidRequest(f"{CONFIG_FILE} is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise InvalidRequest(f"{CONFIG_FILE} must hold a JSON object")
    rank, alpha, modules = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK:
        raise InvalidRequest(f"{CONFIG_FILE} has rank r={rank!r}; expected an integer in [1, {MAX_LORA_RANK}]")
    if alpha != LORA_ALPHA:
        # Scaling is alpha/rank; an adapter trained with another alpha would silently change size.
        raise InvalidRequest(f"{CONFIG_FILE} has lora_alpha={alpha!r}; this server trains with lora_alpha={LORA_ALPHA}")
    if isinstance(modules, str) or not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise InvalidRequest(f"{CONFIG_FILE} target_modules must be a list of module names")
    known = set(ATTN_MODULES) | set(MLP_MODULES) | set(UNEMBED_MODULES)
    unknown = sorted(set(modules) - known)
    if unknown:
        raise InvalidRequest(f"{CONFIG_FILE} targets modules {unknown} that a Tinker LoRA never trains")
    try:
        lora = LoraConfig(
            rank=rank,
            train_attn=any(m in modules for m in ATTN_MODULES),
            train_mlp=any(m in modules for m in MLP_MODULES),
            train_unembed=any(m in modules for m in UNEMBED_MODULES),
        )
    except ValueError as error:
        raise InvalidRequest(f"{CONFIG_FILE} describes no trainable LoRA: {error}") from error
    if sorted(modules) != target_modules(lora):
        raise InvalidRequest(
            f"{CONFIG_FILE} targets {sorted(modules)}; a Tinker LoRA trains whole groups {target_modules(lora)}"
        )
    return lora


def load_weights(params: Mapping[str, torch.nn.Parameter], files: Mapping[str, bytes]) -> None:
    """Copy the file's tensors into the adapter; keys and shapes are all checked before any copy."""
    tensors = tensor_files.read(files, WEIGHTS_FILE)
    tensor_files.check_fit(tensors, params, WEIGHTS_FILE, "this base model")
    tensor_files.copy_into(params, tensors)
