# Entry points, each doing all set-up on a fresh machine (a local venv in .venv):
#   make demo       synthesise a tiny DeepSeek-V4 checkpoint, convert it, verify it, load every rank
#   make test       lint (ruff), type-check (mypy), then every test tier (what CI runs), and its time
#   make test-fast  the unit tier alone (tests/unit, in-process): the loop while editing
# Both run the tests on every core (pytest-xdist: one worker per core, at most PYTEST_WORKERS_MAX),
# the slowest first (tests/conftest.py), handed out one at a time (--maxschedchunk 1: xdist's default hands
# each worker a long run of the queue up front, so one worker would get every slow test and end alone);
# PYTEST_WORKERS=0 runs them in one process.
VENV ?= .venv
# Extra pip arguments for torch. Left empty, it is chosen here: where no NVIDIA driver answers
# (no nvidia-smi) and pip, as configured, finds no torch==2.13.0 without an index (a local wheel
# folder, as CI machines have), torch's CPU build from PyTorch's own index, not PyPI's default
# multi-GB CUDA build. Set it to choose yourself, e.g. TORCH_PIP_ARGS='--index-url URL'.
TORCH_PIP_ARGS ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= auto
PYTEST_WORKERS_MAX ?= 4
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --maxprocesses=$(PYTEST_WORKERS_MAX) \
	--maxschedchunk 1
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast bench report clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	@args='$(TORCH_PIP_ARGS)'; \
	if [ -z "$$args" ] && ! command -v nvidia-smi >/dev/null 2>&1 && \
	   ! $(PY) -m pip install -q --dry-run --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then \
	  args='--index-url $(TORCH_CPU_INDEX)'; \
	fi; \
	echo "installing torch==2.13.0$${args:+ $$args} into $(VENV) (the longest step of a first run)"; \
	$(PY) -m pip install -q torch==2.13.0 $$args
	@echo "installing megamoe-convert and its test dependencies into $(VENV)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	rm -rf demo-out
	$(VENV)/bin/megamoe synth demo-out/checkpoint --preset tiny
	$(VENV)/bin/megamoe inspect demo-out/checkpoint --ep-size 4
	$(VENV)/bin/megamoe convert demo-out/checkpoint demo-out/converted --ep-size 4 --num-redundant-experts 4
	$(VENV)/bin/megamoe verify demo-out/converted --source demo-out/checkpoint --numerics
	$(PY) -m megamoe_convert.cli.demo demo-out/converted

# Every tier in one pytest run (tests/unit, tests/e2e, the engines' tests/test_engines_real.py), the
# slowest tests listed, then the time it all took.
test: $(STAMP)
	@start=$$(date +%s); status=0; \
	$(VENV)/bin/ruff check . && $(VENV)/bin/mypy && \
	$(PYTEST) --durations=20 tests || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s (ruff, mypy, the unit, e2e and engines tiers)"; \
	exit $$status

test-fast: $(STAMP)
	$(PYTEST) --durations=10 -m unit tests/unit

bench: $(STAMP)
	$(PY) benchmarks/bench_convert.py --quick

report: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) benchmarks/make_report.py

clean:
	rm -rf demo-out $(VENV)
