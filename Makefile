# The two commands of the README: `make demo` and `make test`. Both create .venv, install torch
# (TORCH_SPEC, default torch==2.13.0) and this package with its native extension and extras, and
# Azurite (the az:// emulator the tests start; needs npm) under $(VENV)/azurite, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# The versions the suite was last green with (pip constraints); LOCK= installs the newest releases.
LOCK ?= constraints.txt
PIP_LOCK := $(if $(LOCK),-c $(LOCK))
STAMP := $(VENV)/.compile_cache-installed
SOURCES := Makefile pyproject.toml setup.py $(LOCK) $(wildcard csrc/*.cpp csrc/*.h)
# Azurite's blob service for the az:// tests (tests/_object_emulators.py finds it here). 3.35.0:
# the newest whose package.json accepts Node 20 (3.36 wants Node 21, 3.37 Node 22).
AZURITE_VERSION ?= 3.35.0
AZURITE_DIR := $(VENV)/azurite
# Test processes (pytest-xdist), one test file per process at a time (--dist loadfile keeps a
# file's module fixtures in one process). Most of the suite's time is Inductor compiles in child
# processes, so two workers on two cores take ~0.6x the serial time. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
# sshfs and sshd for the network-filesystem test (tests/test_store_network_fs.py mounts a
# loopback sshd twice); installed with apt-get when missing (sudo unless root).
APT ?= $(if $(filter 0,$(shell id -u)),,sudo )apt-get

# `make test-latest`: the compatibility subset (COMPAT_TESTS) in its own venv with the newest
# releases a user gets today (no lock: the newest torch, transformers and what they pull in,
# kernels included), upgraded at every install. The same subset on another torch of the support
# window (pyproject.toml: torch 2.11 to 2.15), e.g. the oldest:
#   make test-latest LATEST_VENV=.venv-2.11 LATEST_TORCH=torch==2.11.0
# Where pip's own configuration caps torch (a constraint file), lift it with
# PIP_CONSTRAINT=/dev/null make test-latest.
LATEST_VENV ?= .venv-latest
LATEST_TORCH ?= torch
# What breaks first when torch or transformers move: the fingerprint (native and Python), the
# keys, the capabilities read from torch's source, precompile's save and load, Llama regions
# with a KV cache, generate, and the demo model's cached start on a fresh node (test_capture).
COMPAT_TESTS ?= tests/test_fingerprint.py tests/test_keys.py tests/test_torch_compat.py \
  tests/test_torch_compat_restored_code.py tests/test_precompile_values.py tests/test_regions.py \
  tests/test_generate.py tests/test_capture.py tests/test_torch_compat_wrapped_forward.py
PIP_UPGRADE := $(if $(LOCK),,--upgrade --upgrade-strategy eager)
# -e: the package is this tree (its extension built in place, compile_cache/_C*.so). The
# compatibility venvs install a copy instead (EDITABLE=), reinstalled at each test-compat, so
# that each keeps an extension built against its own torch; their tests then run with
# PYTHONSAFEPATH=1, which keeps this tree's compile_cache off sys.path.
EDITABLE ?= -e

.PHONY: install demo test test-latest test-compat lint docs bench clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_LOCK) --upgrade pip
	$(PY) -m pip install --quiet $(PIP_LOCK) $(PIP_UPGRADE) "$(TORCH_SPEC)" setuptools wheel "pybind11>=2.12" ninja
	# TORCH_SPEC again: an unlocked upgrade of the extras' dependencies keeps that torch.
	$(PY) -m pip install --quiet $(PIP_LOCK) $(PIP_UPGRADE) --no-build-isolation $(EDITABLE) ".[test,bench,s3,gcs,azure,docs]" "$(TORCH_SPEC)"
	@command -v npm >/dev/null || { echo "npm (Node.js) is needed to install Azurite, the az:// test emulator"; exit 1; }
	test -x $(AZURITE_DIR)/node_modules/.bin/azurite-blob \
	  && grep -q '"version": "$(AZURITE_VERSION)"' $(AZURITE_DIR)/node_modules/azurite/package.json \
	  || npm install --prefix $(AZURITE_DIR) --no-audit --no-fund --save-exact --loglevel=error \
	       azurite@$(AZURITE_VERSION)
	@{ command -v sshfs && { command -v sshd || test -x /usr/sbin/sshd; }; } >/dev/null \
	  || $(APT) install -y -qq sshfs openssh-server >/dev/null 2>&1 \
	  || { $(APT) update -qq >/dev/null && $(APT) install -y -qq sshfs openssh-server >/dev/null; } \
	  || echo "could not install sshfs and openssh-server: tests/test_store_network_fs.py needs them"
	touch $(STAMP)

demo: install
	$(PY) -m compile_cache.demo

test: install
	$(PY) -m ruff check compile_cache tests benchmarks docs
	$(MAKE) --no-print-directory docs
	# Bytecode as an install writes it: with PYTHONDONTWRITEBYTECODE set, each of the suite's
	# child processes would otherwise compile the package's source again (~0.35 s of CPU each).
	$(PY) -m compileall -q compile_cache tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

test-latest:
	$(MAKE) test-compat VENV=$(LATEST_VENV) TORCH_SPEC="$(LATEST_TORCH)" LOCK= EDITABLE=

# The compatibility subset in $(VENV) (test-latest's, or the locked .venv).
test-compat: install
	$(if $(EDITABLE),,$(PY) -m pip install --quiet --no-deps --no-build-isolation --force-reinstall .)
	$(PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|kernels|accelerate) '
	$(PY) -m compileall -q tests
	$(if $(EDITABLE),,PYTHONSAFEPATH=1) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(COMPAT_TESTS)

lint: install
	$(PY) -m ruff check compile_cache tests benchmarks docs

# The docs site (README.md, docs/, benchmarks/RESULTS.md), strict: any warning, such as a link
# to a page, file or heading anchor that does not exist, fails the build (~3 s).
docs: install
	$(PY) -m sphinx -E -W --keep-going -n -q -c docs -b html . docs/_build/html

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build *.egg-info compile_cache/_C*.so docs/_build
