# `make train` and `make test` create .venv from constraints.txt on first use.
# PYTHON selects the interpreter (python3 here is 3.11; `PYENV_VERSION=3.12.1 make test` uses 3.12):
# the venv is rebuilt when the interpreter's version changes.
PYTHON ?= python3
VENV ?= .venv
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
STAMP := $(VENV)/.installed-$(PYVER)

.PHONY: install test train demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[tpu,test]'
	touch $@

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=20 tests

# The main job: trains the default MoE transformer on 8 simulated CPU devices (resumes if
# workdir/default holds a run).
train: $(STAMP)
	$(VENV)/bin/python -m launch.train --workdir=workdir/default --config=launch/configs/default.py

demo: $(STAMP)
	$(VENV)/bin/python -m launch.demo

clean:
	rm -rf $(VENV) build *.egg-info
