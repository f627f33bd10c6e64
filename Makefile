# Convenience wrapper over meson. `make demo` sets everything up and runs the main job;
# `make test` builds and runs the test suite.
BUILD ?= build
MESON_FLAGS ?=
# The interpreter the Python package is built for and its tests run under (the venv
# tools/setup-deps.sh makes: nanobind, numpy, pytest).
KVGC_BUILD_VENV ?= $(HOME)/.cache/kvgc/build-venv
export KVGC_BUILD_VENV
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all deps build demo demo-alloc model test sanitize fuzz fuzz-tokenizer cuda-emu bench clean
FUZZ_SECONDS ?= 60

all: build

deps:
	@tools/setup-deps.sh

$(BUILD)/build.ninja: | deps
	meson setup $(BUILD) -Dpython_exe=$(KVGC_BUILD_VENV)/bin/python $(MESON_FLAGS)

build: $(BUILD)/build.ninja
	ninja -C $(BUILD)

# The main job: a real model (SmolLM2-135M-Instruct, from its PyPI package) answering a
# chat prompt with its KV cache in a kvgc heap under the generational GC at a 25% budget.
DEMO_PROMPT ?= Write a short story about a lighthouse keeper who finds a message in a bottle.
demo: build model
	KVGC_POLICY=generational KVGC_TOKEN_BUDGET=25% $(BUILD)/tools/kvgc-run --chat \
	  --prompt "$(DEMO_PROMPT)" --max-tokens 300 --temperature 0.7 --seed 7

model: deps
	@tools/fetch-model.sh

# The allocator alone: plan a model's KV memory, then serve requests through the heap.
demo-alloc: build
	$(BUILD)/tools/kvgc-plan --config tools/samples/SmolLM2-135M-Instruct.json --budget 2G
	@echo
	$(BUILD)/tools/kvgc-demo

test: build
	meson test -C $(BUILD) --no-rebuild --print-errorlogs

# ASan+UBSan (with LeakSanitizer) over the unit suite, fault sweeps and stress included
# (not kvgc-oom-sweep and kvgc-parser-peak: they replace malloc, which ASan owns);
# TSan over the threads tests and the stress tests (CPU backend; one with attention
# split over 2 workers; the tools are not built there: no thread of theirs is under test).
# ASan builds -O2 with every assert and the invariant walker after each mutation (at -O0
# the suite ran past its timeouts); sanitized code is still slower: timeouts doubled.
# Only what the sanitized suites run is built there (the unit tests need kvgc-run; the model
# suite, the tools' own tests and the benchmarks run in the plain build).
ASAN_TARGETS = tests/kvgc-unit-tests tests/kvgc-c-api-test tests/kvgc-stress tools/kvgc-run
TSAN_TARGETS = tests/kvgc-unit-tests tests/kvgc-stress
sanitize: deps
	[ -f build-asan/build.ninja ] || meson setup build-asan -Dbuildtype=debugoptimized -Dassert_level=2 \
	  -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dtcmalloc=disabled -Dbench=false
	ninja -C build-asan $(ASAN_TARGETS)
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C build-asan --no-rebuild --print-errorlogs --suite unit \
	  --timeout-multiplier 2
	[ -f build-tsan/build.ninja ] || meson setup build-tsan -Db_sanitize=thread -Db_lundef=false \
	  -Dcuda=disabled -Dtcmalloc=disabled -Dbench=false -Dtools=false
	ninja -C build-tsan $(TSAN_TARGETS)
	meson test -C build-tsan --no-rebuild --print-errorlogs unit --test-args='-tc=threads*'
	meson test -C build-tsan --no-rebuild --print-errorlogs stress stress-threads --timeout-multiplier 2

# The CUDA-vs-CPU tests on a host emulation of the CUDA kernels: their logic, no GPU.
cuda-emu: deps
	tests/cuda_emu/run.sh build-emu

# libFuzzer with ASan+UBSan: each harness tests/fuzz/fuzz_NAME.cpp (the C API, the GGUF
# reader, config.json, the entropy profile, the KVGC_* parsers, ...) for FUZZ_SECONDS
# (FUZZ_SECONDS_NAME overrides it for one), one after the other; FUZZERS picks some.
# New inputs go to build-fuzz/corpus/NAME; the seeds in tests/fuzz/corpus/NAME are only
# read. A crash stops the run with its input in build-fuzz/crashes/.
FUZZERS ?= $(sort $(patsubst tests/fuzz/fuzz_%.cpp,%,$(wildcard tests/fuzz/fuzz_*.cpp)))
fuzz: deps
	[ -f build-fuzz/build.ninja ] || CC=clang CXX=clang++ meson setup build-fuzz -Dfuzz=true \
	  -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized -Dassert_level=1 \
	  -Dcuda=disabled -Dtcmalloc=disabled -Dbench=false
	ninja -C build-fuzz $(foreach f,$(FUZZERS),tests/kvgc-fuzz-$(f))
	mkdir -p build-fuzz/crashes
	for f in $(FUZZERS); do \
	  secs=$$(printenv FUZZ_SECONDS_$$f || echo $(FUZZ_SECONDS)); \
	  echo "fuzz: $$f for $$secs s"; mkdir -p build-fuzz/corpus/$$f tests/fuzz/corpus/$$f; \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 build-fuzz/tests/kvgc-fuzz-$$f \
	    -max_total_time=$$secs -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	    -artifact_prefix=build-fuzz/crashes/$$f- build-fuzz/corpus/$$f tests/fuzz/corpus/$$f \
	    > build-fuzz/fuzz-$$f.log 2>&1; rc=$$?; \
	  grep -E "^#[0-9]+ +DONE|^Done|stat::number_of_executed_units|ERROR|SUMMARY" build-fuzz/fuzz-$$f.log; \
	  [ $$rc = 0 ] || { tail -n 40 build-fuzz/fuzz-$$f.log; exit 1; }; \
	done

# The tokenizer's harness alone (the real vocabulary if the model is downloaded, else a
# generated one).
fuzz-tokenizer:
	$(MAKE) fuzz FUZZERS=tokenizer

bench: build
	$(BUILD)/bench/kvgc-bench-alloc
	$(BUILD)/bench/kvgc-bench-gc
	$(BUILD)/bench/kvgc-bench-attend

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz
