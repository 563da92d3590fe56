# serving-truth: see README.md. Every target works from a clean clone.
PYTHON  ?= python3
VENV    ?= .venv
PIN     ?= v0.33.0
MODEL   ?=
RUNTIME ?= auto
SYSTEMS ?= all
LAYOUTS ?= default
LOCK    ?= images.lock
PASS_ENV ?=
CLUSTER ?=
MODE    ?= resolve
SLICE   ?=
PROFILER ?= 1
EXPECTATIONS ?=
BASELINE ?=
ACCEPTED ?=
REPORTS ?= reports
REPLACE ?=
# the engine of the reports `make reports` / `make verify-pins` work on (vllm, sglang); `make audit` takes the pin's
ENGINE ?=
CACHE   ?= 1
FROM    ?=
BIN     := $(VENV)/bin
# $(call q,VALUE): VALUE as one single-quoted shell word, whatever it holds (make audit PIN='x; rm -rf y' audits
# a pin named "x; rm -rf y", which images.lock then refuses; nothing is run)
q = '$(subst ','\'',$(1))'

.PHONY: setup env envs audit render accept diff compare test bench pins models clean clean-containers test-image summary lock-resolve lock-add selftest-gpu verify-pins

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# Build (once, cached under ~/.cache/serving-truth) the environment holding the pinned vLLM wheel.
env: setup
	$(BIN)/serving-truth env $(call q,$(PIN))

# Every pin's environment (they share one copy of torch and CUDA through uv's cache), then list them:
# size, bytes shared, last use. Prune with: .venv/bin/serving-truth envs --prune unpinned|unfinished|all
envs: setup
	@for p in $$($(BIN)/serving-truth pins --lock $(call q,$(LOCK)) --names); do $(BIN)/serving-truth env "$$p" --lock $(call q,$(LOCK)) >/dev/null || exit $$?; done
	$(BIN)/serving-truth envs --lock $(call q,$(LOCK))

# make exits 2 whenever a recipe fails, whatever the tool's code; the recipe prints the tool's own exit
# code (0 ok, 1 findings, 2 bad input, 3 environment, 4 run failed/INCOMPLETE or a harness fault, 5 report not
# written, 6 serving changed against --baseline, 7 nothing judged (a gate that compared no cell),
# 70 internal error, 130 interrupted). A CI gate that needs the code calls .venv/bin/serving-truth directly.
# HOST=pip audits a pip install with no CUDA toolkit instead of the pin's official image (audit/pins/hosts.py);
# its reports and its diff against the image's host go to reports/hosts/pip/.
audit: setup
	@$(BIN)/serving-truth audit $(call q,$(PIN)) $(if $(MODEL),--model $(call q,$(MODEL))) $(if $(HOST),--host $(call q,$(HOST))) --runtime $(call q,$(RUNTIME)) --systems $(call q,$(SYSTEMS)) --layouts $(call q,$(LAYOUTS)) \
		--lock $(call q,$(LOCK)) --mode $(call q,$(MODE)) $(if $(SLICE),--slice $(call q,$(SLICE))) $(if $(filter 0,$(PROFILER)),--no-profiler) \
		$(if $(PASS_ENV),--pass-env $(call q,$(PASS_ENV))) $(if $(CLUSTER),--cluster $(call q,$(CLUSTER))) \
		$(if $(EXPECTATIONS),--expectations $(call q,$(EXPECTATIONS))) $(if $(BASELINE),--baseline $(call q,$(BASELINE))) \
		$(if $(ACCEPTED),--accepted $(call q,$(ACCEPTED))) --reports $(call q,$(REPORTS)) \
		$(if $(filter 1,$(REPLACE)),--replace) $(if $(filter 0,$(CACHE)),--no-cache) \
		|| { rc=$$?; echo "serving-truth audit exited $$rc (see README: exit codes)" >&2; exit $$rc; }

# The pull-request summary of a pin bump (markdown to paste; the top of reports/diffs/<FROM>..<PIN>.md):
#   make summary FROM=v0.32.0 PIN=v0.33.0
summary: setup
	@$(if $(FROM),,echo "make summary needs FROM=<the baseline pin>, e.g. make summary FROM=v0.32.0 PIN=v0.33.0" >&2; exit 2)
	@$(BIN)/serving-truth summary $(call q,$(FROM)) $(call q,$(PIN)) $(if $(MODEL),--model $(call q,$(MODEL))) --reports $(call q,$(REPORTS))

# On a host with one NVIDIA GPU: serve the smallest K3 slice and check that every lane's probes fired.
selftest-gpu: setup
	$(BIN)/serving-truth selftest-gpu --pin $(call q,$(PIN)) $(if $(MODEL),--model $(call q,$(MODEL)))

# Remove containers left behind by serving-truth runs whose harness died (docker runtime).
clean-containers: setup
	$(BIN)/serving-truth clean-containers

# Fill in a pin's registry digests (image, platform_digests) from its registry: make lock-resolve PIN=...
lock-resolve: setup
	$(BIN)/serving-truth lock resolve $(call q,$(PIN)) --lock $(call q,$(LOCK))

# Pin a vLLM build that is not on PyPI (checked: downloaded, hashed, its own metadata read), e.g.
#   make lock-add PIN=nightly-0731 COMMIT=<sha>      a commit's wheel from vLLM's per-commit index
#   make lock-add PIN=nightly-0731 DATE=2026-07-31   main as of that day (the commit is recorded)
#   make lock-add PIN=nightly-1202 NIGHTLY=1          the commit vLLM's nightly index points at now
#   make lock-add PIN=rc WHEEL_URL=https://...whl    IMAGE_TAG=repo:tag adds (or pins only) an image
lock-add: setup
	$(BIN)/serving-truth lock add $(call q,$(PIN)) --lock $(call q,$(LOCK)) $(if $(COMMIT),--commit $(call q,$(COMMIT))) $(if $(DATE),--date $(call q,$(DATE))) \
		$(if $(filter 1,$(NIGHTLY)),--nightly) \
		$(if $(WHEEL_URL),--wheel-url $(call q,$(WHEEL_URL))) $(if $(SHA256),--sha256 $(call q,$(SHA256))) \
		$(if $(IMAGE_TAG),--image-tag $(call q,$(IMAGE_TAG))) $(if $(VLLM_VERSION),--vllm-version $(call q,$(VLLM_VERSION))) \
		$(if $(VARIANT),--variant $(call q,$(VARIANT))) $(if $(INDEX_URL),--index-url $(call q,$(INDEX_URL)))

# Build (root; cached) a local image carrying Python and PIN's engine wheel (vLLM's, SGLang's), and build/test-images.lock
# pinning it as <PIN>-image: then `make audit PIN=<PIN>-image RUNTIME=docker LOCK=build/test-images.lock`.
test-image: setup
	mkdir -p build
	$(BIN)/python tests/images/build_image.py --pin $(call q,$(PIN)) --lock $(call q,$(LOCK)) --lock-out build/test-images.lock

# Re-render a ledger from a run directory's evidence: make render RUN=~/.cache/serving-truth/runs/...
render: setup
	$(BIN)/serving-truth render $(call q,$(RUN)) --lock $(call q,$(LOCK)) --reports $(call q,$(REPORTS)) \
		$(if $(BASELINE),--baseline $(call q,$(BASELINE))) $(if $(ACCEPTED),--accepted $(call q,$(ACCEPTED)))

# Accept every finding of an audited pin for the pin-bump gate (expectations/<model>.accepted.toml):
# make accept PIN=v0.33.0; then make audit PIN=<candidate> BASELINE=v0.33.0 fails only on new findings
accept: setup
	$(BIN)/serving-truth accept $(call q,$(PIN)) $(if $(MODEL),--model $(call q,$(MODEL))) --lock $(call q,$(LOCK)) --reports $(call q,$(REPORTS)) \
		$(if $(ACCEPTED),--accepted $(call q,$(ACCEPTED)))

# reports/diffs/<FROM>..<TO>.md from two audited pins: make diff FROM=v0.30.0 TO=v0.33.0
diff: setup
	$(BIN)/serving-truth diff $(call q,$(FROM)) $(call q,$(TO)) $(if $(MODEL),--model $(call q,$(MODEL))) --reports $(call q,$(REPORTS))

# One model on two engines, side by side: make compare PIN=v0.33.0 WITH=sglang-0.5.23 (both pins' committed reports;
# writes reports/compare/<PIN>..<WITH>.md and .json)
compare: setup
	$(BIN)/serving-truth compare $(call q,$(PIN)) $(call q,$(WITH)) $(if $(MODEL),--model $(call q,$(MODEL))) --lock $(call q,$(LOCK)) --reports $(call q,$(REPORTS))

# Re-audit every pin with a wheel in release order and rewrite reports/ and reports/diffs/ (the committed
# reports are exactly what this writes). Builds one environment at a time and drops it after use.
# FROM_RUNS=1 audits nothing: it renders every pin again from its newest full run (expectations,
# templates or verdict code changed; no vLLM environment needed), and a pin whose runs are gone from its
# committed routing.json. FROM_REPORTS=1 renders every pin from its committed routing.json (no run read):
# `make reports FROM_REPORTS=1 MODEL=deepseek-v3`.
FROM_RUNS ?=
FROM_REPORTS ?=
# Check the harness against every pinned release (fences, stand-in fit, availability): make reports runs it first.
verify-pins: setup
	$(BIN)/serving-truth verify-pins --lock $(call q,$(LOCK)) $(if $(PINS),--pins $(call q,$(PINS))) $(if $(MODEL),--model $(call q,$(MODEL))) $(if $(ENGINE),--engine $(call q,$(ENGINE)))

reports: setup
	$(if $(filter 1,$(FROM_RUNS) $(FROM_REPORTS)),,$(BIN)/serving-truth verify-pins --lock $(call q,$(LOCK)) $(if $(MODEL),--model $(call q,$(MODEL))) $(if $(ENGINE),--engine $(call q,$(ENGINE))))
	$(BIN)/serving-truth regenerate --lock $(call q,$(LOCK)) $(if $(MODEL),--model $(call q,$(MODEL))) $(if $(ENGINE),--engine $(call q,$(ENGINE))) $(if $(filter 1,$(FROM_RUNS)),--from-runs) $(if $(filter 1,$(FROM_REPORTS)),--from-reports)

pins: setup
	$(BIN)/serving-truth pins --lock $(call q,$(LOCK))

# The models the harness audits (make audit MODEL=<name>; default kimi-k3)
models: setup
	$(BIN)/serving-truth models

# two test processes, each a whole test file at a time (pytest-xdist): an audit keeps about 1.3 of 2 cores busy, so
# two files at once fill the gaps; TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) --durations=30

bench: setup
	$(BIN)/python benchmarks/bench_counting.py
	$(BIN)/python benchmarks/bench_audit.py --pin $(call q,$(PIN))

clean:
	rm -rf $(VENV) build *.egg-info

# Observe mode's mechanics below vLLM on any NVIDIA GPU with torch and Triton (no vLLM): trace reader,
# CUDA-graph hooks, vLLM's own K3 KDA Triton kernels against the kernel-name map (tests/gpu_mechanics).
# `make k3-kda-src` (here, with the pinned wheel cached) builds build/k3-kda-src, the KDA sources they run.
GPU_PYTHON ?= python3
.PHONY: selftest-gpu-mechanics bench-gpu-counting k3-kda-src
k3-kda-src: setup
	$(BIN)/python tests/gpu_mechanics/k3_kda_src.py
selftest-gpu-mechanics:
	SERVING_TRUTH_REQUIRE_GPU=1 $(GPU_PYTHON) -m pytest -m gpu tests/gpu_mechanics -v -rs
bench-gpu-counting:
	$(GPU_PYTHON) benchmarks/bench_gpu_counting.py
