# The two commands of the README: `make demo` and `make test`. Both create .venv, install torch
# (TORCH_SPEC, default torch==2.13.0) and this package with its native extension, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.compile_cache-installed
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" setuptools wheel "pybind11>=2.12" ninja
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,bench,s3]"
	touch $(STAMP)

demo: install
	$(PY) -m compile_cache.demo

test: install
	$(PY) -m ruff check compile_cache tests benchmarks
	$(PY) -m pytest -q tests

lint: install
	$(PY) -m ruff check compile_cache tests benchmarks

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build *.egg-info compile_cache/_C*.so
