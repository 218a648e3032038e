"""Process settings: one object per process, from flags and `OPENRL_*` environment variables.

Nothing else reads the environment. Every field says what it does; unknown keys are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, cast

from pydantic import Field, PrivateAttr, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated

from openrl_core.errors import InvalidRequest
from openrl_core.ids import check_tenant_name, tenant_for_key
from openrl_core.quantity import parse_bytes
from openrl_core.quotas import Quotas, limits_for

DEFAULT_API_KEY = "tml-openrl-local"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPENRL_", extra="forbid")
    _quotas_kept: dict = PrivateAttr(default_factory=dict)  # tenant -> (what they were made from, `quotas`)

    host: str = Field("127.0.0.1", description="address the gateway listens on")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="level of the process's log lines (DEBUG, INFO, WARNING or ERROR)"
    )
    port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on")
    data_dir: Path = Field(Path(".data"), description="event log, event store and blobs of the embedded deployment")
    database_url: Optional[str] = Field(
        None, description="SQLAlchemy URL of the event store; default a SQLite file in data_dir"
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [DEFAULT_API_KEY],
        description="accepted API keys, comma-separated; an entry `tenant=key` names the key's tenant",
    )
    operator_api_key: Optional[SecretStr] = Field(
        None,
        description="a key (starting 'tml-') for the operator: on the OpenRL API (/api/openrl/v1, `openrl runs`) it "
        "sees and cancels every tenant's runs; it is no tenant's key, so the Tinker API refuses it. Unset: no operator",
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="base models served (comma-separated); empty serves every catalogue model"
    )
    local_models: dict[str, str] = Field(
        default_factory=dict, description="extra base models: name -> local Hugging Face model directory"
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="extra base_model names served with another served model's weights and tokenizer: alias -> name "
        '(JSON), e.g. {"Qwen/Qwen3-8B": "openrl/tiny-qwen3"} so recipes that pick renderers by name run unchanged',
    )
    model_cache: Optional[Path] = Field(None, description="where materialised models are cached")
    device: str = Field("cpu", description="torch device of the workers")
    long_poll_seconds: float = Field(
        25.0, gt=0, le=40, description="how long retrieve_future holds an unfinished future"
    )
    event_stream_seconds: float = Field(
        25.0,
        gt=0,
        le=300,
        description="how long a run's event stream (GET /api/openrl/v1/runs/{id}/events) stays open before "
        "it ends and the client reconnects where it left off",
    )
    inline_payload_limit: int = Field(
        256 * 1024, ge=1024, description="event payloads above this many bytes go to the blob store by reference"
    )
    bus: Literal["embedded", "kafka"] = Field(
        "embedded", description="the event log: the embedded SQLite log (one process) or Kafka (distributed)"
    )
    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated, when bus=kafka"
    )
    kafka_fetch_max_wait_ms: int = Field(
        500,
        ge=1,
        le=10_000,
        description="longest a consumer's fetch waits at the broker for records when bus=kafka (Kafka's default 500); "
        "lower it for brokers that hold every fetch that long (Tansu), which otherwise adds it to each event's latency",
    )
    # 1 ms by default: on a broker that holds an empty fetch (Kafka, for kafka_fetch_max_wait_ms)
    # a fetch comes back empty once per wait, so the pause costs nothing there; on noida-db,
    # which answers at once, idle consumers without it spun, taking a core from the rest of a
    # busy machine (README.md at 40db992, futures bench: one process per role).
    kafka_idle_poll_pause_ms: int = Field(
        1,
        ge=0,
        le=1000,
        description="when bus=kafka and above 0: a consumer whose fetch found nothing pauses this long before the next "
        "instead of fetching again at once; for brokers that answer an empty fetch at once instead of holding it for "
        "kafka_fetch_max_wait_ms (noida-db), on which idle consumers otherwise spin a core. Adds up to this much latency; "
        "0: no pause",
    )
    log_partitions: int = Field(
        4, ge=1, le=64, description="partitions per topic (embedded log, and Kafka topics OpenRL creates)"
    )
    log_fsync: bool = Field(True, description="embedded log: fsync every append (SQLite synchronous=FULL)")
    instance_id: Optional[str] = Field(
        None,
        description="stable identity of this worker replica (e.g. a StatefulSet pod name); a restarted replica with "
        "the same id takes its partitions over at once. Default: <role>-<hostname>",
    )
    snapshot_every_steps: int = Field(
        10, ge=0, description="trainer: snapshot a model every this many optim_steps for recovery by replay (0: never)"
    )
    sampler_max_batch_rows: int = Field(64, ge=1, description="rows (prompts x samples) one sampler batch may hold")
    sampler_max_adapters: int = Field(16, ge=1, description="adapters a sampler keeps loaded per base model (LRU)")
    share_base_weights: bool = Field(
        True,
        description="one process running the LoRA trainer and the sampler keeps one copy of a base model's frozen "
        "weights for both (full fine-tuning weights are never shared)",
    )
    release_host_memory: bool = Field(
        True, description="trainer and sampler: return memory a pass freed to the system (glibc malloc_trim) after it"
    )
    release_host_memory_idle_ms: float = Field(
        1000.0,
        ge=0,
        description="return it once no worker of the process has worked for this long (a trim makes "
        "the next pass fault its pages in again; see openrl_core.idleness)",
    )
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest request body the gateway reads")
    blob_collector_seconds: float = Field(
        300.0,
        ge=0,
        description="how often blobs no record needs any more are deleted (0: never); see functions/collector",
    )
    blob_grace_seconds: float = Field(
        600.0, ge=0, description="the blob collector never deletes a blob written less than this many seconds ago"
    )
    sampler_versions_kept: int = Field(
        4,
        ge=1,
        description="newest ephemeral sampler versions (save_weights_and_get_sampling_client) of a training run "
        "whose weights stay while its session is open; older ones are collected and answer 410",
    )
    # -- per-tenant quotas (see openrl_core/quotas.py); over one a submission gets a 429 ----
    quota_requests_in_flight: Optional[int] = Field(
        None, ge=1, description="per tenant: submitted requests (futures) not yet finished; unset: no limit"
    )
    quota_queued_training_tokens: Optional[int] = Field(
        None, ge=1, description="per tenant: tokens of submitted forward / forward_backward requests not yet finished; "
        "unset: no limit",
    )  # fmt: skip
    quota_sampling_tokens_per_minute: Optional[int] = Field(
        None, ge=1, description="per tenant: sampling tokens (prompt + max_tokens x num_samples) submitted in the last "
        "60 s, a sliding window; unset: no limit",
    )  # fmt: skip
    quota_checkpoint_bytes: Optional[int] = Field(
        None, ge=1, description="per tenant: bytes (or with a unit: 10GiB) its live checkpoints may hold; saves are refused "
        "once it is reached; unset: no limit",
    )  # fmt: skip
    tenant_quotas: dict[str, dict[str, Optional[int | str]]] = Field(
        default_factory=dict,
        description='per-tenant overrides of the quota_* defaults (JSON), e.g. {"alice": {"requests_in_flight": '
        '8, "checkpoint_bytes": "1GiB"}}; null lifts a limit for that tenant',
    )
    checkpoint_reaper_seconds: float = Field(
        60.0, gt=0, description="how often expired checkpoints and the blobs only they used are removed"
    )
    download_link_seconds: int = Field(
        3600, ge=60, le=7 * 24 * 3600, description="how long an external-weights download link stays valid"
    )
    download_secret: Optional[SecretStr] = Field(
        None, description="HMAC key that signs download links; default a random key kept in data_dir/download-secret"
    )
    public_url: Optional[str] = Field(
        None, description="base URL that download links start with; default the URL the request came in on"
    )
    metadata_only_threshold_bytes: int = Field(
        1024 * 1024,
        ge=0,
        description="retrieve_future answers complete_metadata (size first, payload on the next poll) for results above "
        "this many bytes when the client allows it",
    )
    audit_dedup_window: int = Field(
        10_000,
        ge=256,
        description="audit: ids of this many last lines per tenant file are remembered, so a redelivered event "
        "(at most one uncommitted batch of 256) is never written twice",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="address `openrl metrics` serves Prometheus /metrics on, apart from the gateway's `host`: /metrics "
        "needs no key and names every tenant, so keep it on a private address (or loopback, the default)",
    )
    metrics_port: int = Field(
        9464, ge=0, le=65535, description="port the metrics function serves Prometheus /metrics on"
    )
    metrics_checkpoint_seconds: float = Field(
        5.0, gt=0, description="metrics: how often its state is saved and its log offsets committed"
    )
    metrics_dedup_window: int = Field(
        100_000,
        ge=512,
        description="metrics: event ids remembered to ignore redeliveries; state is also saved every half window of events",
    )
    metrics_rate_window_seconds: float = Field(
        60.0, gt=0, description="metrics: the trailing window that the tokens-per-second gauges average over"
    )
    otel_endpoint: Optional[str] = Field(
        None,
        description="OTLP/HTTP endpoint (e.g. http://collector:4318, or its full /v1/traces URL) the projector exports one "
        "OpenTelemetry trace per finished request to, built from the request's stored events (queued, run, store); "
        "unset (the default): no trace is built and OpenTelemetry's SDK is never imported",
    )
    otel_service_name: str = Field(
        "openrl", min_length=1, description="the `service.name` resource attribute of the exported traces"
    )

    # -- shared accelerators: the node's timeslicer, full fine-tuning, delta sync -----------
    timeslicer_socket: Optional[Path] = Field(
        None,
        description="Unix socket of the node's timeslicer daemon (`openrl timeslicer`); unset: `openrl serve` runs one "
        "in-process on <data_dir>/timeslicer.sock, and a worker started alone keeps a private in-process one",
    )
    accelerator_memory: Optional[int] = Field(
        None,
        description="memory budget per accelerator in bytes or with a unit (6GiB, 512MiB): jobs beyond it park; "
        "default on CUDA 90% of the device's memory, on CPU no limit",
    )
    accelerators: int = Field(1, ge=1, le=64, description="CPU only: how many accelerators the timeslicer models")
    timeslicer_policy: Literal["fifo", "lrs"] = Field(
        "lrs", description="turn order: first come first served, or least recently served (both with aging)"
    )
    lease_seconds: float = Field(
        10.0, gt=0, le=600, description="a turn's lease lifetime; holders renew it every third"
    )
    timeslicer_aging_seconds: float = Field(30.0, gt=0, description="a waiter older than this is served first")
    timeslicer_affinity_seconds: float = Field(
        0.1,
        ge=0,
        description="after a run's turn, how long the device waits for that run's next request (its step is several "
        "requests) before serving another run; 0 turns affinity off",
    )
    timeslicer_quantum_seconds: float = Field(
        10.0, gt=0, description="longest a run is served in a row through affinity"
    )
    timeslicer_http_port: int = Field(
        9465, ge=0, le=65535, description="port of the daemon's /metrics, /status, /healthz"
    )
    full_finetune_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="served base_model names (comma-separated) whose training runs are full fine-tuning, for recipes "
        'that cannot pass user_metadata {"openrl.full_finetune": "true"}',
    )
    serving_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype a full run's weights are published to samplers in (deltas compare its bits)"
    )
    delta_full_every: int = Field(
        20, ge=0, description="publish a full checkpoint after this many deltas in a row (0: only when needed)"
    )
    delta_max_share: float = Field(
        0.5, gt=0, le=1, description="publish a full checkpoint instead of a delta larger than this share of it"
    )
    gateway_threads: int = Field(
        40,
        ge=1,
        description="worker threads for the gateway's blocking work (store reads, appends): requests that "
        "wait on the store and the log side by side are group-committed together",
    )
    gateway_inline_body_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="on a SQLite store, a training or create_model request up to this many body "
        "bytes, of a tenant without quotas, is checked and queued on the gateway's event loop instead of in one of "
        "its threads (0: always in a thread)",
    )
    trainer_packing: bool = Field(
        True,
        description="run ready forward_backward requests of several LoRA models on one base model as shared "
        "passes (false: each model's requests in passes of their own)",
    )
    trainer_pack_linger_ms: float = Field(
        5.0,
        ge=0,
        description="while several LoRA models train, how long the trainer waits for more requests to "
        "share a pass (0: no packing wait)",
    )
    trainer_cohort_wait_ms: float = Field(
        100.0,
        ge=0,
        description="while several LoRA models train, how long a pass waits for requests of the models "
        "active lately that have none in it yet (it stops once each has one; see openrl_core.cohort)",
    )
    sampler_cohort_wait_ms: float = Field(
        100.0,
        ge=0,
        description="while several runs sample, how long a sampler batch waits for the runs active lately "
        "that have no request in it yet (it stops once each has one; see openrl_core.cohort)",
    )
    trainer_pack_max_tokens: int = Field(
        8192, ge=16, description="padded tokens one trainer pass may hold (several models' requests share passes)"
    )
    trainer_pack_max_rows: int = Field(256, ge=1, description="sequences one trainer pass may hold")
    trainer_release_runs_after_s: float = Field(
        900.0,
        ge=0,
        description="seconds without a request after which the trainer releases a run's state from "
        "memory (snapshotted first; its next request restores it, bitwise); 0: never. Needs snapshot_every_steps > 0",
    )
    trainer_pack_max_shared_mib: int = Field(
        1024,
        ge=1,
        description="estimated activation memory (logits + saved decoder activations) of a pass "
        "several models share; bigger requests run in passes of their own, where sharing stops paying",
    )
    trainer_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="trainer dtypes (functions/trainer/precision.py): float32 everywhere, or bfloat16 (LoRA: bf16 "
        "base, float32 adapters and Adam state; full runs: float32 master weights and Adam state, bf16 autocast); "
        "auto: bfloat16 on CUDA, float32 elsewhere (bitwise reproducible on CPU)",
    )
    trainer_full_shards: int = Field(
        1,
        ge=1,
        description="devices a full fine-tuning run is sharded over with torch FSDP2 (one rank process per GPU, "
        "cuda:0..N-1 over NCCL; on CPU, N processes over gloo); 1: one device. Checkpoints are then sharded "
        "safetensors, which any shard count loads (docs/memory.md)",
    )
    trainer_activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward instead of keeping them (about a "
        "third more compute, activations no longer grow with depth; see docs/memory.md)",
    )
    sampler_max_full_models: int = Field(
        2, ge=1, description="full fine-tuned weight sets a sampler keeps per base model (least recently used leaves)"
    )

    # -- sampling engine: torch (in process) or vLLM (a child process from its own venv) ------
    sampler_engine: Literal["torch", "vllm"] = Field(
        "torch", description="sampler engine: the batched torch engine, or vLLM (needs `make vllm`, see docs/guide.md)"
    )
    vllm_env: Optional[Path] = Field(
        None, description="virtualenv holding vLLM (default: .venv-vllm beside the code, built by `make vllm`)"
    )
    vllm_max_loras: int = Field(
        4,
        ge=1,
        description="LoRA slots of a vLLM engine: adapters one step runs together (more in a batch wait their turn)",
    )
    vllm_max_lora_rank: int = Field(
        32,
        ge=1,
        le=512,
        description="LoRA rank a vLLM engine sizes its slots for at start; a higher-rank adapter restarts it",
    )
    vllm_kv_cache_gib: int = Field(1, ge=1, description="vLLM KV cache size on CPU, whole GiB")
    vllm_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype vLLM computes in (float32 matches the torch engine to 1e-4; bfloat16 suits GPUs)"
    )
    vllm_tensor_parallel_size: int = Field(
        1, ge=1, le=8, description="CUDA: GPUs one vLLM sampler engine spans (tensor parallelism)"
    )
    vllm_sleep_level: Literal[0, 1, 2] = Field(
        1,
        description="CUDA: vLLM sleep level a parked engine uses (1: weights to host memory, KV cache dropped; "
        "2: both dropped, weights reloaded on wake; 0: never sleeps)",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="share of GPU memory a vLLM engine may take on CUDA (weights and KV cache)"
    )

    # -- Kubernetes: `openrl scheduler`, the controller that places worker StatefulSets --------
    namespace: str = Field("openrl", description="Kubernetes namespace the scheduler creates worker StatefulSets in")
    scheduler_policy: Literal["binpack", "spread"] = Field(
        "binpack", description="placement of workers on accelerators: binpack (fewest devices, time-sliced) or spread"
    )
    scheduler_interval_seconds: float = Field(10.0, gt=0, description="how often the scheduler reconciles workers")
    scheduler_idle_minutes: float = Field(
        15.0,
        ge=1,
        description="a worker whose runs sent no request for this many minutes is released (minutes, not seconds: "
        "a run between steps is only briefly idle, and a GPU worker's cold start takes minutes)",
    )
    scheduler_unplaced_grace_seconds: float = Field(
        300.0,
        ge=0,
        description="a run with pending requests whose worker has had no accelerator this long has them failed "
        "with the reason, instead of leaving its client polling forever",
    )
    scheduler_base_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="base models whose trainer and sampler stay up even with no session (comma-separated); the "
        "rest start on demand",
    )
    scheduler_job_memory: dict[str, str] = Field(
        default_factory=dict,
        description="accelerator memory a trainer or sampler of a base model keeps resident, e.g. "
        '{"openrl/tiny-qwen3": "1GiB"} (JSON); others get scheduler_default_job_memory',
    )
    scheduler_default_job_memory: str = Field(
        "8GiB", description="accelerator memory of a worker not in scheduler_job_memory"
    )
    scheduler_full_finetune_factor: float = Field(
        4.0, ge=1, description="a full fine-tuning trainer needs this many times its base model's worker memory "
        "(weights, gradients, two Adam moments)",
    )  # fmt: skip
    scheduler_timeslicer_port: int = Field(
        9465, ge=1, le=65535, description="HTTP port of the node timeslicers whose /status the scheduler reads"
    )

    @field_validator("otel_endpoint", mode="before")
    @classmethod
    def _check_otel_endpoint(cls, value):
        if value == "":  # OPENRL_OTEL_ENDPOINT= (set but empty) is off, as unset is
            return None
        if isinstance(value, str) and not value.startswith(("http://", "https://")):
            raise ValueError(f"otel_endpoint must be an http:// or https:// URL, not {value!r}")
        return value

    @field_validator("accelerator_memory", mode="before")
    @classmethod
    def _parse_bytes(cls, value):
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("quota_checkpoint_bytes", mode="before")
    @classmethod
    def _parse_quota_bytes(cls, value):
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("tenant_quotas")
    @classmethod
    def _check_tenant_quotas(cls, value: dict) -> dict:
        for tenant in value:
            limits_for(Quotas(), value, tenant)  # unknown limit names and bad values fail at start
        return value

    def quotas(self, tenant: str) -> tuple[Quotas, frozenset[str]]:
        """The tenant's limits, and which come from its tenant_quotas entry. Asked twice on
        every submission, and building the models each time was a tenth of a gateway
        thread's work per future: kept per tenant, under the values they were made from."""
        own = self.tenant_quotas.get(tenant)
        made_from = (
            self.quota_requests_in_flight, self.quota_queued_training_tokens, self.quota_sampling_tokens_per_minute,
            self.quota_checkpoint_bytes, None if own is None else repr(own),
        )  # fmt: skip
        # Through the private-attribute dict itself: pydantic answers `self._quotas_kept` in
        # its __getattr__, 1.7 us here, most of this call's cost (three a submission).
        cache = cast(dict, self.__pydantic_private__)["_quotas_kept"]  # (None only without private attributes)
        kept = cache.get(tenant)
        if kept is not None and kept[0] == made_from:
            return kept[1]
        defaults = Quotas(
            requests_in_flight=self.quota_requests_in_flight,
            queued_training_tokens=self.quota_queued_training_tokens,
            sampling_tokens_per_minute=self.quota_sampling_tokens_per_minute,
            checkpoint_bytes=self.quota_checkpoint_bytes,
        )
        limits = limits_for(defaults, self.tenant_quotas, tenant)
        cache[tenant] = (made_from, limits)
        return limits

    @field_validator("scheduler_default_job_memory")
    @classmethod
    def _check_memory(cls, value: str) -> str:
        parse_bytes(value)
        return value

    @field_validator("scheduler_job_memory")
    @classmethod
    def _check_memories(cls, value: dict[str, str]) -> dict[str, str]:
        for size in value.values():
            parse_bytes(size)
        return value

    @field_validator("api_keys", "models", "full_finetune_models", "scheduler_base_models", mode="before")
    @classmethod
    def _split_commas(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def tenant_keys(self) -> dict[str, str]:
        """API key -> tenant id."""
        keys: dict[str, str] = {}
        for entry in self.api_keys:
            tenant, sep, key = entry.partition("=")
            if not sep:
                tenant, key = tenant_for_key(entry), entry
            if not key.startswith("tml-"):
                raise InvalidRequest("API keys must start with 'tml-' (the tinker SDK refuses any other)")
            keys[key] = check_tenant_name(tenant)
        return keys

    def operator_key(self) -> Optional[str]:
        if self.operator_api_key is None:
            return None
        key = self.operator_api_key.get_secret_value()
        if not key.startswith("tml-"):
            raise InvalidRequest(
                "operator_api_key must start with 'tml-' (the tinker SDK and the CLI send only such keys)"
            )
        if key in self.tenant_keys():
            raise InvalidRequest("operator_api_key must differ from every tenant's key in api_keys")
        return key

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'events.db').resolve()}"
