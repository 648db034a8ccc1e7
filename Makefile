# The everyday commands. `make demo` and `make test` each set up everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
# bench/kv_quality.py (and its test) read The Devil's Dictionary (public domain) from Debian's dict-devil.
BENCH_TEXT := /usr/share/dictd/devil.dict.dz

.PHONY: setup demo up test lint typecheck gen bench

setup:
	./tools/setup.sh

demo: setup  ## the whole mesh on loopback with SmolLM2, one streamed chat, the trace
	$(PY) -m services.cli.main demo

up: setup  ## the mesh on the default ports until Ctrl-C
	$(PY) -m services.cli.main up

test: setup lint $(BENCH_TEXT)  ## lint, then every test (real processes, real redis-server)
	$(PY) -m pytest

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck:
	$(VENV)/bin/mypy

gen:  ## regenerate the gRPC stubs from protos/
	$(PY) tools/gen_protos.py

bench: $(BENCH_TEXT)  ## CPU decode benchmark; writes bench/results/
	$(PY) bench/decode_cpu.py

$(BENCH_TEXT):
	$(if $(filter 0,$(shell id -u)),,sudo) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dict-devil >/dev/null'
