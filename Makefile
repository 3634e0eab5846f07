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

.PHONY: install demo test lint docs bench clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_LOCK) --upgrade pip
	$(PY) -m pip install --quiet $(PIP_LOCK) "$(TORCH_SPEC)" setuptools wheel "pybind11>=2.12" ninja
	$(PY) -m pip install --quiet $(PIP_LOCK) --no-build-isolation -e ".[test,bench,s3,gcs,azure,docs]"
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
