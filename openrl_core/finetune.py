"""Which kind of training run a create_model asks for: a LoRA adapter or full fine-tuning.

The unmodified SDK has no full fine-tuning call, so a run asks for it through
`user_metadata={"openrl.full_finetune": "true"}`, or the operator declares served names
that always mean it (`OPENRL_FULL_FINETUNE_MODELS`, e.g. an alias for a cookbook recipe).
An explicit "false" in the metadata wins over the list. A full run trains every weight:
LoRA's module switches make no sense for it and are refused when turned off; the rank and
seed the SDK always sends are ignored (nothing is drawn at random: a run starts from the
base weights).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from openrl_core.errors import InvalidRequest
from openrl_core.params import LoraConfig

FULL_FINETUNE_KEY = "openrl.full_finetune"
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def is_full_finetune(base_model: str, user_metadata: Optional[Mapping[str, Any]], full_models: Iterable[str]) -> bool:
    value = (user_metadata or {}).get(FULL_FINETUNE_KEY)
    if value is not None:
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise InvalidRequest(f"user_metadata[{FULL_FINETUNE_KEY!r}] must be 'true' or 'false', got {value!r}")
    return base_model in set(full_models)


def check_full_finetune_config(lora: Optional[LoraConfig]) -> None:
    if lora is None:
        return
    off = [name for name in ("train_attn", "train_mlp", "train_unembed") if not getattr(lora, name)]
    if off:
        raise InvalidRequest(
            f"full fine-tuning trains every weight; {', '.join(f'{n}=False' for n in off)} only applies to LoRA runs "
            "(leave them at their defaults; rank and seed are ignored for a full run)"
        )
