# The two entry points of the README. Both create or reuse the virtual environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashmask3-installed

.PHONY: demo test test-slow test-all venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(PY) -m flashmask3.train.cli demo

# test: the suite with each slow kernel test once (tests/conftest.py, SLOW_MATRIX_MODULES);
# test-slow: the rest of those matrices; test-all: both (CI runs test, then test-slow). Tests marked gpu run only where CUDA is.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
