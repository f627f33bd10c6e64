# Convenience wrapper over meson. `make demo` sets everything up and runs the main job;
# `make test` builds and runs the test suite.
BUILD ?= build
MESON_FLAGS ?=
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all deps build demo test sanitize bench clean

all: build

deps:
	@tools/setup-deps.sh

$(BUILD)/build.ninja: | deps
	meson setup $(BUILD) $(MESON_FLAGS)

build: $(BUILD)/build.ninja
	ninja -C $(BUILD)

# The main job (until the reference engine lands): plan a real model's KV memory, then
# serve requests through the allocator on the CPU backend.
demo: build
	$(BUILD)/tools/kvgc-plan --config tools/samples/SmolLM2-135M-Instruct.json --budget 2G
	@echo
	$(BUILD)/tools/kvgc-demo

test: build
	meson test -C $(BUILD) --no-rebuild --print-errorlogs

# ASan+UBSan (with LeakSanitizer) over the unit suite, fault sweeps and stress included;
# TSan over the threads test and the stress test (CPU backend).
sanitize: deps
	[ -f build-asan/build.ninja ] || meson setup build-asan -Dbuildtype=debug \
	  -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dtcmalloc=disabled -Dbench=false
	ninja -C build-asan
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C build-asan --no-rebuild --print-errorlogs --suite unit
	[ -f build-tsan/build.ninja ] || meson setup build-tsan -Db_sanitize=thread -Db_lundef=false \
	  -Dcuda=disabled -Dtcmalloc=disabled -Dbench=false
	ninja -C build-tsan
	meson test -C build-tsan --no-rebuild --print-errorlogs unit --test-args='-tc=threads*'
	meson test -C build-tsan --no-rebuild --print-errorlogs stress

bench: build
	$(BUILD)/bench/kvgc-bench-alloc
	$(BUILD)/bench/kvgc-bench-gc
	$(BUILD)/bench/kvgc-bench-attend

clean:
	rm -rf $(BUILD) build-asan build-tsan
