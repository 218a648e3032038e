"""The event store's schema: the events themselves and the projections folded from them.

`events` is the source of truth; every other table can be dropped and rebuilt by replaying
it (`eventing/replay.py`). The schema changes only through Alembic (`migrations/`);
`tests/eventing/test_migrations.py` fails when these tables and the migrations drift.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# The global order of the store; BigInteger autoincrement on PostgreSQL, rowid on SQLite.
Position = BigInteger().with_variant(Integer(), "sqlite")

events = Table(
    "events",
    metadata,
    Column("position", Position, primary_key=True, autoincrement=True),
    # The CloudEvent id is unique: a redelivered event is stored once, and a concurrent
    # double write becomes an IntegrityError instead of a silent duplicate.
    Column("id", String(64), nullable=False, unique=True),
    Column("type", String(160), nullable=False),
    Column("source", String(200), nullable=False),
    Column("tenant", String(64), nullable=False),
    Column("key", String(200)),
    Column("subject", String(200)),
    Column("time", DateTime(timezone=True), nullable=False),
    Column("data", LargeBinary),
    Column("claim_sha256", String(64)),
    Column("claim_size", BigInteger),
    # The submission identity the gateway deduplicated this event by, so a replay rebuilds
    # the submissions table too (a refused submission is its seq.skipped event).
    Column("dedup_key", String(300)),
    Column("dedup_sha256", String(64)),
    Column("dedup_rejected", Boolean),
    # The timeslicer lease a worker's event was produced under (its fencing token), and
    # whether the store refused to apply it because a later lease of the same key had
    # already been applied: a refused event is kept, for audit, and projects nothing.
    Column("lease_id", BigInteger),
    Column("fenced", Boolean),
    Index(None, "tenant", "type"),
    Index(None, "key"),
)

# Gateway-emitted events that are stored but not yet on the log (transactional outbox).
outbox = Table(
    "outbox",
    metadata,
    Column("event_id", String(64), primary_key=True),
    Column("topic", String(200), nullable=False),
)

# (model_id, seq_id) and friends: what makes a retried submission return its first future.
submissions = Table(
    "submissions",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("dedup_key", String(300), primary_key=True),
    Column("request_id", String(64)),
    Column("payload_sha256", String(64), nullable=False),
    Column("rejected", Boolean, nullable=False, default=False),
)

futures = Table(
    "futures",
    metadata,
    Column("request_id", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("session_id", String(64)),
    Column("model_id", String(200)),
    Column("state", String(16), nullable=False),
    Column("result", JSON),
    Column("error", Text),
    Column("category", String(16)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("completed_at", DateTime(timezone=True)),
    # What the request is charged against its tenant's token quotas (openrl_core.quotas):
    # a forward_backward's datum tokens, a sample's prompt + max_tokens x num_samples.
    Column("tokens", BigInteger),
    # What billing usage counts (openrl_core.billing): a sample's prompt tokens, set with the
    # request, and the tokens its completion returned over every sequence. A forward_backward's
    # training tokens are `tokens` itself.
    Column("prefill_tokens", BigInteger),
    Column("sampled_tokens", BigInteger),
    Index(None, "tenant", "session_id"),
    # The quota reads: a tenant's unfinished futures (as many as its in-flight limit lets
    # it have), and its futures of the last minute (the sampling window).
    Index(None, "tenant", "state"),
    Index(None, "tenant", "created_at"),
    # A run's or sampling session's futures (a fork's request, a session's finished samples,
    # a cancel's open futures): by tenant alone these read every future the tenant ever had.
    # The tenant leads, so SQLite (which plans without statistics) prefers this index to
    # (tenant, state) where a read names all three.
    Index(None, "tenant", "model_id", "state"),
    # Billing usage reads a tenant's training and sampling futures by the hour they completed
    # in. The kind sits before the time so that reads ordered by completed_at alone (a
    # session's finished samples) keep the (tenant, model_id, state) index: with (tenant,
    # completed_at), SQLite chose it for them and sorted every future of the tenant.
    Index(None, "tenant", "kind", "completed_at"),
)

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("tags", JSON, nullable=False),
    Column("user_metadata", JSON, nullable=False),
    Column("sdk_version", String(64)),
    Column("project_id", String(200)),
    Column("display_name", String(200)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("last_heartbeat_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("finish_reason", String(32)),
    Index(None, "tenant"),
)

training_runs = Table(
    "training_runs",
    metadata,
    Column("model_id", String(200), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("session_id", String(64), nullable=False),
    Column("base_model", String(300), nullable=False),
    Column("is_lora", Boolean, nullable=False),
    Column("lora_rank", Integer),
    Column("lora_config", JSON),
    Column("user_metadata", JSON),
    Column("state", String(16), nullable=False),
    Column("error", Text),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("last_request_time", DateTime(timezone=True), nullable=False),
    Column("last_checkpoint", String(300)),
    Column("last_sampler_checkpoint", String(300)),
    Column("cancelled_at", DateTime(timezone=True)),
    # A fork's parent run and the step of it the fork started from (see openrl_core.forking).
    Column("forked_from_run", String(200)),
    Column("forked_from_step", Integer),
    Index(None, "tenant"),
    Index(None, "session_id"),  # a session listing's counts
)

# One row per optim_step of a run, folded from the completions (which the trainer emits in
# seq order, so the fold needs no reordering): the step's training forward_backward calls
# add their loss and tokens to the run's open row (completed_at NULL), and its optim_step
# closes it. What `openrl runs show --metrics` and the metrics route read.
run_steps = Table(
    "run_steps",
    metadata,
    Column("model_id", String(200), primary_key=True),
    Column("step", Integer, primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("loss", Float),  # sum of the step's forward_backward "loss:sum" metrics
    Column("tokens", BigInteger, nullable=False),
    Column("forward_backward", Integer, nullable=False),
    Column("learning_rate", Float),
    Column("grad_norm", Float),
    Column("metrics", JSON),  # the optim_step's own metrics, as the trainer reported them
    Column("first_request_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True)),
    Column("completed_at", DateTime(timezone=True)),
    Index(None, "tenant"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("tenant", String(64), nullable=False),
    Column("run_id", String(200), primary_key=True),
    Column("checkpoint_id", String(300), primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("tinker_path", String(600), nullable=False),
    Column("files", JSON, nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True)),
    Column("user_metadata", JSON),
    Column("public", Boolean, nullable=False, default=False),
    # With the run: by the tenant alone SQLite chose it over the primary key for one run's
    # checkpoints, and read every checkpoint of the tenant.
    Index(None, "tenant", "run_id"),
    Index(None, "expires_at"),  # the reaper's sweep (`Projections.expired_checkpoints`), every minute
)

# The stored intervals of checkpoints that are gone: deleted, expired, or replaced by a
# same-named save. A checkpoint's row leaves `checkpoints` then, and with it the time it was
# saved; billing's storage gigabyte-hours integrate over these intervals too, so the usage
# of an hour does not shrink when a checkpoint stored in it is deleted later.
removed_checkpoints = Table(
    "removed_checkpoints",
    metadata,
    # The id of the event that removed it (one event removes at most one checkpoint).
    Column("removed_by", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("run_id", String(200), nullable=False),
    Column("checkpoint_id", String(300), nullable=False),
    Column("saved_at", DateTime(timezone=True), nullable=False),
    # When it stopped being stored: the removal, or its expires_at if that came first.
    Column("removed_at", DateTime(timezone=True), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Index(None, "tenant", "removed_at"),
)

sampling_sessions = Table(
    "sampling_sessions",
    metadata,
    Column("sampling_session_id", String(200), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("session_id", String(64), nullable=False),
    Column("base_model", String(300), nullable=False),
    Column("model_path", String(600)),
    Column("adapter", JSON),
    Column("weights", JSON),  # a full run's: the manifest of its published weights
    Column("created_at", DateTime(timezone=True), nullable=False),
    # The training run whose weights it samples (saved by it, or a checkpoint of it), and
    # when cancelling that run closed it.
    Column("run_id", String(200)),
    Column("closed_at", DateTime(timezone=True)),
    Index(None, "tenant"),
    Index(None, "session_id"),  # a session listing's counts
    Index(None, "tenant", "run_id"),  # a run's sampling sessions
)

# The highest lease each key's (model's) applied events carried: an event under a lower
# lease comes from a holder that was fenced (paused, replaced) and is refused.
lease_fences = Table(
    "lease_fences",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("lease_id", BigInteger, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    # Only the SHA-256 of a key is ever stored.
    Column("key_sha256", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)
