# `make train` and `make test` create the venv from constraints.txt on first use.
# PYTHON selects the interpreter (python3 here is 3.11; `PYENV_VERSION=3.12.1 make test` uses 3.12):
# the venv is rebuilt when the interpreter's version changes; VENV names another folder
# (`.ci/run` keeps one per Python).
PYTHON ?= python3
VENV ?= .venv
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
STAMP := $(VENV)/.installed-$(PYVER)
# Two pytest workers: XLA:CPU compiles on one thread, so two use both cores of a small machine.
# Tests that share a module-level cache or fixture run on one worker (tests/conftest.py).
PYTEST := $(VENV)/bin/python -m pytest -n 2 --dist loadgroup -rs --durations=20

.PHONY: install test test-fast test-memory test-tpu train demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[tpu,test]'
	touch $@

# Everything, the slow end-to-end cases included: what CI runs. First the layering contracts
# (pyproject.toml's [tool.importlinter]): an import that runs up a layer fails the build.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PYTEST) tests

# The edit-test loop: every test not marked slow.
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PYTEST) -m "not slow" tests

# The Maverick memory guard (tests/test_memory_guard.py) on this Python's jax, compiled (minutes),
# against that jax's committed baseline: `make test` reads the figures back while the baseline
# is of the same program; `PYENV_VERSION=3.12.1 make test-memory VENV=.venv-3.12` checks jax
# 0.12's compiler.
test-memory: $(STAMP)
	MOE_HK_MEMORY_GUARD=1 $(VENV)/bin/python -m pytest -rs -s tests/test_memory_guard.py

# The tests that need a TPU chip (marked `tpu`; they skip in `make test`), on this host's chip:
# one process, as one program holds a chip at a time.
test-tpu: $(STAMP)
	MOE_HK_TPU=1 $(VENV)/bin/python -m pytest -rs -m tpu tests

# The main job: trains the default MoE transformer on 8 simulated CPU devices (resumes if
# workdir/default holds a run).
train: $(STAMP)
	$(VENV)/bin/python -m launch.train --workdir=workdir/default --config=launch/configs/default.py

demo: $(STAMP)
	$(VENV)/bin/python -m launch.demo

clean:
	rm -rf $(VENV) build *.egg-info
