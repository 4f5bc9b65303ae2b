# Two entry points, each doing all set-up on a fresh machine (a local venv in .venv):
#   make demo   synthesise a tiny DeepSeek-V4 checkpoint, convert it, verify it, load every rank
#   make test   run the whole test suite
VENV ?= .venv
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'
# on a machine without a local CPU wheel (PyPI's torch is a multi-GB CUDA build).
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench report clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	rm -rf demo-out
	$(VENV)/bin/megamoe synth demo-out/checkpoint --preset tiny
	$(VENV)/bin/megamoe inspect demo-out/checkpoint --ep-size 4
	$(VENV)/bin/megamoe convert demo-out/checkpoint demo-out/converted --ep-size 4 --num-redundant-experts 4
	$(VENV)/bin/megamoe verify demo-out/converted --source demo-out/checkpoint --numerics
	$(PY) -m megamoe_convert.cli.demo demo-out/converted

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/bench_convert.py --quick

report: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) benchmarks/make_report.py

clean:
	rm -rf demo-out $(VENV)
