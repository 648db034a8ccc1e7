# The everyday commands. `make demo` and `make test` each set up everything first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo up test lint typecheck gen bench sla

setup:
	THERMOCLINE_VENV=$(VENV) ./tools/setup.sh

demo: setup  ## the whole mesh on loopback with SmolLM2, one streamed chat, the trace
	$(PY) -m services.cli.main demo

up: setup  ## the mesh on the default ports until Ctrl-C
	$(PY) -m services.cli.main up

# Most engine tests compute in process (the Triton interpreter, CPU models; marked in_process by
# tests/engine/conftest.py): they run in TEST_WORKERS processes (pytest-xdist). The rest start
# services and wait on deadlines, so they run one at a time, where a loaded machine cannot starve them.
TEST_WORKERS ?= 2

test: setup lint  ## lint, then every test (real processes, real redis-server)
	$(PY) -m pytest -n $(TEST_WORKERS) -m in_process tests/engine
	$(PY) -m pytest -m "not in_process"

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck:
	$(VENV)/bin/mypy

gen:  ## regenerate the gRPC stubs from protos/
	$(PY) tools/gen_protos.py

bench: setup  ## CPU decode benchmark; writes bench/results/
	$(PY) bench/decode_cpu.py

sla: setup  ## SLA calibration sweep with SmolLM2 on the CPU (a few minutes); writes bench/results/sla_cpu_*
	$(PY) bench/sla_cpu.py
