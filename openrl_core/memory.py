"""The memory model: how many accelerator bytes a LoRA or full fine-tuning run needs.

Pure arithmetic over a model's published dimensions (`ModelShape`), a precision, a shard
count and a batch shape; no torch. The trainer registers `resident` bytes with the
timeslicer, the scheduler places workers by them, and `docs/memory.md` is its table.

Precisions (what `functions/trainer/precision.py` runs):

- `float32`: every tensor float32 (the CPU default, bitwise reproducible).
- `bfloat16`: LoRA runs keep the frozen base in bf16 and the adapter (weights, gradients, Adam
  moments) in float32; full runs keep float32 master weights, float32 gradients and both
  Adam moments, and compute under bf16 autocast (autocast holds a bf16 copy of each weight
  from the forward until the backward has used it: `weight_casts`).

Bytes per element, per run (P = parameters of the model, A = of the adapter, N = shards):

    LoRA   base P * (4 | 2)          shared by every adapter on the base, never parked
           state A * 16              float32 weights, gradients, two moments
    full   state P * 16 / N          float32 master weights, gradients, two moments (FSDP
                                     shards all four evenly; N = 1 unsharded)
           weight_casts P * 2        bf16 only, transient; sharded: two layers gathered instead

Activations kept for the backward, per token (h hidden, q = heads * head_dim,
kv = kv_heads * head_dim, i intermediate, S = 6h + 4q + 4kv + 4i; SDPA attention keeps no
T x T matrix; r residual-stream bytes: 4 for full runs, the compute dtype's for LoRA):

    per layer     c * S, c = LAYER_BYTES_PER_ELEMENT[kind, precision] (4.0 for float32 full
                  runs: every product's input in float32), + 4 * rank per adapted linear
    checkpointed  r * h per layer (its input), plus one layer's full set while it recomputes
    outside       2 * r * h (the embedding's output, the final norm)
    logits        4 * vocab per token, up to `KEEP_LOGITS_ELEMENTS` (then chunks recompute)

The coefficients c were fitted to the bytes autograd actually saves on the tiny Qwen3
(tests/functions/trainer/test_memory_measured.py holds the model to the saved tensors and
the allocated state of the real trainer, tests/openrl_core/test_memory.py to hand-computed
values); for another architecture they are an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from openrl_core.errors import InvalidRequest

Precision = Literal["float32", "bfloat16"]
PRECISIONS: tuple[Precision, ...] = ("float32", "bfloat16")
RunKind = Literal["lora", "full"]

# Logits elements a pass keeps for its backward before it recomputes them chunk by chunk
# (functions/trainer/batching.py KEEP_LOGITS_ELEMENTS + one LOGITS_CHUNK_ELEMENTS chunk).
KEEP_LOGITS_ELEMENTS = 2**26 + 2**24
ADAPTED = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen-family decoder that fix its memory."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3 normalises q and k per head (a head_dim weight each)

    @classmethod
    def from_config(cls, config: Mapping) -> "ModelShape":
        """From a Hugging Face config.json dict (a multimodal one's `text_config`)."""
        config = config.get("text_config", config)
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qk_norm=config.get("model_type") == "qwen3",
            )
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidRequest(f"config has no decoder dimensions the memory model reads: {error}") from error

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear maps, name -> (in_features, out_features)."""
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def layer_parameters(self) -> int:
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return sum(a * b for a, b in self.linears().values()) + norms

    def parameters(self) -> int:
        """Elements of the weights, tied embeddings counted once (no biases: Qwen3, Llama)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + head + self.num_layers * self.layer_parameters() + self.hidden_size

    def lora_parameters(self, rank: int, attn: bool = True, mlp: bool = True, unembed: bool = True) -> int:
        """Elements of a rank-`rank` adapter on the chosen modules (A: r x in, B: out x r)."""
        wanted = (ADAPTED["attn"] if attn else ()) + (ADAPTED["mlp"] if mlp else ())
        per_layer = sum(rank * (a + b) for name, (a, b) in self.linears().items() if name in wanted)
        head = rank * (self.hidden_size + self.vocab_size) if unembed else 0
        return self.num_layers * per_layer + head


@dataclass(frozen=True)
class Batch:
    """One forward_backward's shape: `rows` sequences of `tokens` (padded) each."""

    rows: int
    tokens: int

    @property
    def positions(self) -> int:
        return self.rows * self.tokens


@dataclass(frozen=True)
class Estimate:
    """Bytes on one device (one rank of a sharded run). `resident` is what stays between
    turns (what the timeslicer parks); `peak` adds what one pass holds while it runs."""

    base: int  # frozen base weights (LoRA; shared, never parked); 0 for a full run
    state: int  # trained weights, gradients, optimizer moments (this rank's shard)
    transient: int  # weight casts or gathered shards, while a pass runs
    activations: int  # kept for the backward, while a pass runs

    @property
    def resident(self) -> int:
        return self.base + self.state

    @property
    def peak(self) -> int:
        return self.resident + self.transient + self.activations


def compute_bytes(precision: Precision) -> int:
    if precision not in PRECISIONS:
        raise InvalidRequest(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return 4 if precision == "float32" else 2


def lora_state_bytes(adapter_elements: int) -> int:
    """An adapter's resident bytes: float32 weights, gradients and two Adam moments."""
    return 16 * adapter_elements


def full_state_bytes(parameters: int, shards: int = 1) -> int:
    """A full run's resident bytes on one rank: float32 master weights, gradients, two moments.
    FSDP shards each tensor's first dimension in `shards` even pieces (padded): ceil."""
    if shards < 1:
        raise InvalidRequest(f"shards must be at least 1, got {shards}")
    return 16 * -(-parameters // shards)


# Bytes autograd keeps per element of S = 6h + 4q + 4kv + 4i (one decoder layer, one token),
# by run kind and precision; fitted to the tiny Qwen3 (see the module docstring). A frozen
# base (LoRA) keeps no layer inputs for weight gradients; bf16 autocast over float32 master
# weights keeps the float32 residual stream beside the bf16 casts of the products' inputs.
LAYER_BYTES_PER_ELEMENT = {("full", "float32"): 4.0, ("full", "bfloat16"): 2.7,
                           ("lora", "float32"): 3.25, ("lora", "bfloat16"): 2.0}  # fmt: skip


def residual_bytes(kind: RunKind, precision: Precision) -> int:
    """Bytes of one element of the residual stream: float32 master weights (full runs) keep it
    float32 even under autocast; a bf16 LoRA base computes it in bf16."""
    return 4 if kind == "full" else compute_bytes(precision)


def decoder_activation_bytes(
    shape: ModelShape, batch: Batch, precision: Precision, kind: RunKind = "full", checkpointing: bool = False,
    lora_rank: int = 0,
) -> int:  # fmt: skip
    """Bytes the decoder (not the vocabulary projection) keeps for the backward of one pass.
    Checkpointed: each layer's input, plus one layer's full set while it recomputes."""
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    compute_bytes(precision)  # refuses an unknown precision
    per_layer = LAYER_BYTES_PER_ELEMENT[(kind, precision)] * (6 * h + 4 * q + 4 * kv + 4 * i)
    if kind == "lora":
        per_layer += 4 * lora_rank * len(shape.linears())  # each adapted linear's x A^T, float32
    residual = residual_bytes(kind, precision)
    outside = 2 * residual * h  # the embedding's output and the final norm
    if checkpointing:
        layers = residual * h * shape.num_layers + per_layer
    else:
        layers = per_layer * shape.num_layers
    return int(batch.positions * (layers + outside))


def logits_bytes(shape: ModelShape, batch: Batch) -> int:
    """The float32 logits a pass keeps for the backward, up to where it recomputes them."""
    return 4 * min(batch.positions * shape.vocab_size, KEEP_LOGITS_ELEMENTS)


def activation_bytes(
    shape: ModelShape, batch: Batch, precision: Precision, kind: RunKind = "full", checkpointing: bool = False,
    lora_rank: int = 0,
) -> int:  # fmt: skip
    """Bytes autograd keeps for the backward of one pass: decoder plus logits."""
    return decoder_activation_bytes(shape, batch, precision, kind, checkpointing, lora_rank) + logits_bytes(
        shape, batch
    )


def estimate(
    shape: ModelShape,
    kind: RunKind,
    precision: Precision,
    batch: Batch | None = None,
    shards: int = 1,
    checkpointing: bool = False,
    lora_rank: int = 32,
) -> Estimate:
    """A run's bytes on one device. LoRA: all modules adapted (Tinker's default)."""
    b = compute_bytes(precision)
    if kind not in ("lora", "full"):
        raise InvalidRequest(f"unknown run kind {kind!r}; choose lora or full")
    rank = lora_rank if kind == "lora" else 0
    activations = activation_bytes(shape, batch, precision, kind, checkpointing, rank) if batch else 0
    params = shape.parameters()
    if kind == "lora":
        if shards != 1:
            raise InvalidRequest("LoRA runs are not sharded: the base is shared by every adapter on one device")
        return Estimate(params * b, lora_state_bytes(shape.lora_parameters(lora_rank)), 0, activations)
    if b == 4:
        transient = 0 if shards == 1 else 2 * 4 * shape.layer_parameters()
    else:
        transient = 2 * params if shards == 1 else 2 * 2 * shape.layer_parameters()
    return Estimate(0, full_state_bytes(params, shards), transient, activations)


def fits(estimate_: Estimate, device_bytes: int, headroom: float = 0.9) -> bool:
    """Whether a run's peak fits a device, leaving (1 - headroom) for the allocator, CUDA
    context and fragmentation."""
    return estimate_.peak <= device_bytes * headroom


def shape_of(name: str) -> "ModelShape | None":
    """The shape of a catalogue model (the tiny Qwen3 from its config) or of a published one
    whose dimensions the catalogue records; None for a model known only by its files."""
    from openrl_core.catalog import BUILTIN, PUBLISHED_CONFIGS

    spec = BUILTIN.get(name)
    if spec is not None and spec.source == "config":
        return ModelShape.from_config(spec.params["config"])
    config = PUBLISHED_CONFIGS.get(name)
    return ModelShape.from_config(config) if config is not None else None


def resolve_precision(setting: str, device: str) -> Precision:
    """The `trainer_precision` setting on a device: `auto` is bf16 on CUDA, float32 elsewhere."""
    if setting == "auto":
        return "bfloat16" if device.split(":", 1)[0] == "cuda" else "float32"
    compute_bytes(setting)  # type: ignore[arg-type]  # refuses an unknown name
    return setting  # type: ignore[return-value]


def trainer_bytes(
    shape: ModelShape, kind: RunKind, precision: Precision, pass_tokens: int, checkpointing: bool = False,
    lora_rank: int = 32,
) -> int:  # fmt: skip
    """Peak bytes a trainer worker needs on its device: a LoRA trainer's base, one adapter and
    its largest pass (`pass_tokens` padded tokens, trainer_pack_max_tokens); a full run's
    own trainer its whole state and one pass. What the scheduler places by."""
    batch = Batch(rows=1, tokens=pass_tokens)
    return estimate(shape, kind, precision, batch, 1, checkpointing, lora_rank).peak
