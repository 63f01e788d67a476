# DS4Server build.
#
#   make          CPU build: build/ds4server, build/libds4.so, build/libds4.a
#   make cuda     adds the CUDA backend: build/cuda/ds4server (sm_90 SASS + PTX)
#   make test     every test this machine can run (C, CUDA-if-GPU, Python oracles, fuzz smoke)
#   make asan     the test suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   make fuzz     build the libFuzzer targets; FUZZ_SECONDS=N make fuzz-run
#   make audit    check linked libraries against docs/licenses.md
#   make oracle   regenerate tests/oracle/fixtures from transformers (ORACLE_PYTHON=/path/to/python with torch)
#   make demo     the README's first command: set up and run on the demo model

SHELL    := /bin/bash
CC       ?= cc
NVCC     ?= nvcc
PYTHON   ?= python3
BUILD    ?= build
VENV     ?= .venv
OPT      ?= -O2
SAN      ?=
FUZZ_SECONDS ?= 20

WARN     := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wno-unused-parameter
CFLAGS_ALL := -std=c11 -D_DEFAULT_SOURCE -D_FILE_OFFSET_BITS=64 $(OPT) -g -fPIC -pthread \
              -ffp-contract=off $(WARN) -Iinclude -Isrc $(SAN) $(CFLAGS)
LDFLAGS_ALL := -pthread $(SAN) $(LDFLAGS)
LDLIBS_ALL  := -ledit -lz -lcjson -lpcre2-8 -lcivetweb -lm $(LDLIBS)

# Library sources: everything under src/ except the tools (the binary's main)
# and the CUDA units (built only by `make cuda`).
LIB_SRCS  := $(sort $(wildcard src/core/*.c src/backends/*.c src/backends/cpu/*.c src/models/*.c \
               src/models/*/*.c src/text/*.c src/session/*.c src/server/*.c src/api/*.c))
TOOL_SRCS := $(sort $(wildcard src/tools/*.c))
CUDA_SRCS := $(sort $(wildcard src/backends/cuda/*.cu))
TEST_SRCS := $(sort $(wildcard tests/c/test_*.c))
CUDA_TEST_SRCS := $(sort $(wildcard tests/cuda/test_*.c))

LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o)
TOOL_OBJS := $(TOOL_SRCS:%.c=$(BUILD)/obj/%.o)
TEST_BINS := $(TEST_SRCS:tests/c/%.c=$(BUILD)/tests/%)
TEST_TOOL_SRCS := $(sort $(wildcard tests/tools/*.c))
TEST_TOOLS := $(TEST_TOOL_SRCS:tests/tools/%.c=$(BUILD)/tests/tools/%)
HARNESS_OBJ := $(BUILD)/obj/tests/c/test.o

# Keep intermediate objects (test objects are otherwise deleted after linking).
.SECONDARY:

.PHONY: all cuda test test-c test-cuda test-python test-fuzz asan fuzz fuzz-run audit demo venv clean oracle oracle-check

all: $(BUILD)/ds4server $(BUILD)/libds4.so $(BUILD)/libds4.a

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -c $< -o $@

$(BUILD)/libds4.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libds4.so: $(LIB_OBJS)
	$(CC) -shared -Wl,-soname,libds4.so.0 $(LDFLAGS_ALL) -o $@ $^ $(LDLIBS_ALL)

$(BUILD)/ds4server: $(TOOL_OBJS) $(BUILD)/libds4.a
	$(CC) $(LDFLAGS_ALL) -o $@ $(TOOL_OBJS) $(BUILD)/libds4.a $(LDLIBS_ALL)

$(BUILD)/tests/%: $(BUILD)/obj/tests/c/%.o $(HARNESS_OBJ) $(BUILD)/libds4.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $< $(HARNESS_OBJ) $(BUILD)/libds4.a $(LDLIBS_ALL)

$(BUILD)/tests/tools/%: $(BUILD)/obj/tests/tools/%.o $(BUILD)/libds4.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $< $(BUILD)/libds4.a $(LDLIBS_ALL)

$(BUILD)/obj/tests/%.o: tests/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Itests/c -MMD -MP -c $< -o $@

# ---------------------------------------------------------------- CUDA build
# Compute capability 9.0 machine code (H100/H200) plus compute_90 PTX, so other
# NVIDIA GPUs of capability >= 9.0 JIT-compile it. The runtime is linked
# statically (libcudart_static); only the driver (libcuda.so) is dynamic.
CUDA_BUILD := $(BUILD)/cuda
CUDA_ARCH  ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS  := -std=c++17 -O3 -g -lineinfo $(CUDA_ARCH) -Xcompiler -fPIC,-Wall,-Wextra,-Werror,-Wno-unused-parameter \
              -Iinclude -Isrc -DDS4_WITH_CUDA=1 --fmad=true
CUDA_LIB_OBJS := $(LIB_SRCS:%.c=$(CUDA_BUILD)/obj/%.o) $(CUDA_SRCS:%.cu=$(CUDA_BUILD)/obj/%.o)
CUDA_TOOL_OBJS := $(TOOL_SRCS:%.c=$(CUDA_BUILD)/obj/%.o)
CUDA_LDLIBS := -lcudart_static -ldl -lrt -lstdc++ $(LDLIBS_ALL)
CUDA_LIBDIR ?= $(shell dirname $$(dirname $$(command -v $(NVCC) 2>/dev/null || echo /usr/local/cuda/bin/nvcc)))/lib64
CUDA_TEST_BINS := $(CUDA_TEST_SRCS:tests/cuda/%.c=$(CUDA_BUILD)/tests/%)

cuda: $(CUDA_BUILD)/ds4server $(CUDA_BUILD)/libds4.so $(CUDA_TEST_BINS) $(CUDA_BUILD)/tools/persist_probe

# a measurement of the GPU alone (grid barriers, chained weight reads; no model):
# docs/persistent-decode.md, gpu-check.sh's probe stage
$(CUDA_BUILD)/tools/persist_probe: scripts/persist_probe.cu
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -lineinfo $(CUDA_ARCH) -Xcompiler -Wall,-Wextra,-Werror $< -o $@

$(CUDA_BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DDS4_WITH_CUDA=1 -MMD -MP -c $< -o $@

$(CUDA_BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(CUDA_BUILD)/libds4.a: $(CUDA_LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(CUDA_BUILD)/libds4.so: $(CUDA_LIB_OBJS)
	$(CC) -shared -Wl,-soname,libds4.so.0 $(LDFLAGS_ALL) -L$(CUDA_LIBDIR) -o $@ $^ $(CUDA_LDLIBS)

$(CUDA_BUILD)/ds4server: $(CUDA_TOOL_OBJS) $(CUDA_BUILD)/libds4.a
	$(CC) $(LDFLAGS_ALL) -L$(CUDA_LIBDIR) -o $@ $(CUDA_TOOL_OBJS) $(CUDA_BUILD)/libds4.a $(CUDA_LDLIBS)

$(CUDA_BUILD)/tests/%: $(CUDA_BUILD)/obj/tests/cuda/%.o $(CUDA_BUILD)/obj/tests/c/test.o $(CUDA_BUILD)/libds4.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -L$(CUDA_LIBDIR) -o $@ $^ $(CUDA_LDLIBS)

$(CUDA_BUILD)/obj/tests/%.o: tests/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DDS4_WITH_CUDA=1 -Itests/c -MMD -MP -c $< -o $@

# ---------------------------------------------------------------- tests
HAVE_NVCC := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)

test: test-c test-cuda test-python test-fuzz
	@echo "make test: all test groups passed"

test-c: $(TEST_BINS) $(BUILD)/ds4server
	@set -e; for t in $(TEST_BINS); do $$t; done

ifeq ($(HAVE_NVCC),1)
test-cuda: cuda
	@set -e; for t in $(CUDA_TEST_BINS); do $$t; done
	@tests/cuda/persist_probe_args.sh $(CUDA_BUILD)/tools/persist_probe
else
test-cuda:
	@echo "test-cuda: SKIPPED (nvcc not found: the CUDA build was not compiled)"
endif

$(VENV)/.stamp: tests/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r tests/requirements.txt
	@touch $@

venv: $(VENV)/.stamp

test-python: $(VENV)/.stamp $(BUILD)/ds4server $(TEST_TOOLS)
	DS4SERVER=$(abspath $(BUILD)/ds4server) DS4_TEST_TOOLS=$(abspath $(BUILD)/tests/tools) \
	  $(VENV)/bin/python -m pytest -q -rs tests/python

# ---------------------------------------------------------------- fuzzing
FUZZ_SRCS := $(sort $(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BINS := $(FUZZ_SRCS:tests/fuzz/%.c=$(BUILD)/fuzz/%)
FUZZ_CC   ?= clang
FUZZ_LIB_SRCS := $(filter src/core/% src/text/%,$(LIB_SRCS))

fuzz: $(FUZZ_BINS)

$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZ_LIB_SRCS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c11 -D_DEFAULT_SOURCE -O1 -g -Iinclude -Isrc -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=all -o $@ $< $(FUZZ_LIB_SRCS) -lcjson -lpcre2-8 -lm

# fuzz_request includes the request parser's source (the fuzz build links only core and text).
$(BUILD)/fuzz/fuzz_request: src/server/request.c src/server/request.h

# A bounded run of each target from the seed corpus; FUZZ_SECONDS sets the time.
# A crashing input is saved under $(BUILD)/fuzz/ (never in the tree).
fuzz-run test-fuzz: $(FUZZ_BINS)
	@set -e; for f in $(FUZZ_BINS); do \
	  name=$$(basename $$f); mkdir -p $(BUILD)/fuzz/corpus-$$name; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz/$$name- \
	    $(BUILD)/fuzz/corpus-$$name tests/fuzz/seeds 2>&1 \
	    | grep -E "^(stat::number_of_executed_units|stat::average_exec_per_sec|Done|==.*ERROR|SUMMARY)" ; \
	  test $${PIPESTATUS[0]} -eq 0; \
	done

# ---------------------------------------------------------------- sanitizers
asan:
	$(MAKE) BUILD=build-asan OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" \
	  test-c test-python

# ---------------------------------------------------------------- oracle fixtures
# Reference logits from Hugging Face transformers (needs torch + transformers 5.17,
# which tests/requirements.txt deliberately does not install; see tests/oracle/README.md).
ORACLE_PYTHON ?= $(PYTHON)

oracle:
	$(ORACLE_PYTHON) tests/oracle/gen_fixtures.py

oracle-check:
	$(ORACLE_PYTHON) tests/oracle/gen_fixtures.py --check

audit: all
	@scripts/audit.sh $(BUILD)/ds4server $(BUILD)/libds4.so $(if $(HAVE_NVCC),$(CUDA_BUILD)/ds4server $(CUDA_BUILD)/libds4.so)

demo: all
	@scripts/demo.sh

clean:
	rm -rf build build-asan

-include $(shell find $(BUILD) build-asan -name '*.d' 2>/dev/null)
