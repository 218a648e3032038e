"""Small value objects shared by the wire, the events and the workers.

Field names and defaults are exactly the Tinker SDK's (`tinker.types.LoraConfig`,
`AdamParams`, `DimuonParams`, `SamplingParams`), so one object travels from the HTTP body through the event
log to the trainer or sampler unchanged. Validation here is what the gateway enforces.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LORA_RANK = 512


class ValueObject(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# LoraConfig's validator as JSON Schema (for the gateway's OpenAPI description): not every
# train_* flag false.
TRAIN_FLAGS = ("train_unembed", "train_mlp", "train_attn")
NOTHING_TRAINS = {"required": list(TRAIN_FLAGS), "properties": {name: {"const": False} for name in TRAIN_FLAGS}}


class LoraConfig(ValueObject):
    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra={"not": NOTHING_TRAINS})
    rank: int = Field(32, ge=1, le=MAX_LORA_RANK, description="LoRA rank")
    seed: Optional[int] = Field(None, description="seed of the adapter's initialisation")
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    @model_validator(mode="after")
    def _something_trains(self) -> "LoraConfig":
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError("lora_config must train at least one of unembed, mlp or attn")
        return self


class AdamParams(ValueObject):
    learning_rate: float = Field(1e-4, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(0.0, ge=0.0, description="0 means no clipping")

    @field_validator("*")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class DimuonParams(ValueObject):
    """`tinker.types.DimuonParams` (SDK 0.38): one Dimuon step's hyperparameters (see
    functions/trainer/dimuon.py for the update). Fields and bounds are the SDK's."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0.0)
    grad_clip_norm: float = Field(0.0, description="nonpositive values disable clipping")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="EMA coefficient of the momentum")

    @field_validator("learning_rate", "grad_clip_norm", "beta1")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


# The optimizer families a training model can be created with (`optimizer_config.type`).
ADAMW, DIMUON = "adamw", "dimuon"
OPTIMIZER_CONFIGS = {ADAMW: {"type": ADAMW}, DIMUON: {"type": DIMUON, "version": 1}}


def check_optimizer_config(config: Optional[dict]) -> dict:
    """The canonical optimizer_config of a create request (None: AdamW), or ValueError saying
    what is wrong: the families are `tinker.types.AdamOptimizerConfig` and
    `DimuonOptimizerConfig` (version 1), which forbid other fields."""
    config = dict(config or {"type": ADAMW})
    family = config.get("type", ADAMW)
    if family not in OPTIMIZER_CONFIGS:
        raise ValueError(f"optimizer {family!r} is not offered; this server trains with 'adamw' or 'dimuon'")
    config.setdefault("type", family)
    if family == DIMUON:
        config.setdefault("version", 1)
    if config != OPTIMIZER_CONFIGS[family]:
        raise ValueError(f"optimizer_config {config} is not one this server knows; use {OPTIMIZER_CONFIGS[family]}")
    return dict(OPTIMIZER_CONFIGS[family])


StopSpec = Union[str, list[str], list[int], None]


class SamplingParams(ValueObject):
    max_tokens: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None
    # None: stop at the model's end-of-sequence tokens. A non-empty list adds stops to EOS
    # (as vLLM does); [] is the one way to ask for no stop at all, not even EOS.
    stop: StopSpec = None
    temperature: float = Field(1.0, ge=0.0)
    # -1 or a positive count (the validator below); stated in the JSON Schema as well.
    top_k: int = Field(-1, json_schema_extra={"anyOf": [{"const": -1}, {"minimum": 1}]})
    top_p: float = Field(1.0, gt=0.0, le=1.0)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (no limit) or a positive integer")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("temperature must be finite")
        return value

    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        if isinstance(self.stop, list) and self.stop and isinstance(self.stop[0], str):
            return list(self.stop)  # type: ignore[arg-type]
        return []

    def stop_token_ids(self) -> list[int]:
        if isinstance(self.stop, list) and self.stop and isinstance(self.stop[0], int):
            return list(self.stop)  # type: ignore[arg-type]
        return []

    @property
    def stops_at_eos(self) -> bool:
        return not (isinstance(self.stop, list) and len(self.stop) == 0)
