# Phalanx: `make demo` runs a multi-rank CPU job through injected faults;
# `make test` runs the whole suite. Both bootstrap the virtualenv first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed

.PHONY: venv test test-fast demo engine images test-docker bench-detect bench-recovery bench-user-loop bench-unmodified bench-hangs bench-sharded bench-failover bench-elastic bench-checkpoint proto proto-check lint typecheck clean corpus

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins torch to the CPU wheel on local disk on the dev/CI machines.
	# The bench-* targets need the test extra too: bench.checkpoint's S3 server (moto) and s3fs.
	$(PY) -m pip install -q -c constraints.txt -e '.[server,test]'
	@touch $(STAMP)

test: venv
	$(PY) -m pytest

test-fast: venv
	$(PY) -m pytest -m "not slow"

demo: venv
	$(PY) -m phalanx.devstack.demo

# A private Docker engine (Debian's docker.io, installed when missing; no bridge, no
# iptables, its data under /tmp/phalanx-engine, removed on Ctrl-C): see deploy/README.md
engine: venv
	$(PY) -m phalanx.devstack.engine /tmp/phalanx-engine

# Phalanx's images into the engine at DOCKER_HOST (`make engine` prints it)
images: venv
	$(PY) -m phalanx.devstack.images

# The Docker tests alone: their own private engine, the images, compose, testcontainers
test-docker: venv
	$(PY) -m pytest -m docker

bench-detect: venv
	$(PY) -m bench.detect

bench-recovery: venv
	$(PY) -m bench.recovery

bench-user-loop: venv
	$(PY) -m bench.recovery --loop user --nproc 3

bench-unmodified: venv
	$(PY) -m bench.recovery --loop unmodified

bench-hangs: venv
	$(PY) -m bench.hangs

bench-sharded: venv
	$(PY) -m bench.recovery --parallel hsdp

bench-failover: venv
	$(PY) -m bench.failover

bench-elastic: venv
	$(PY) -m bench.elastic

bench-checkpoint: venv
	$(PY) -m bench.checkpoint

proto: venv
	$(PY) -m phalanx.contract.proto write proto

proto-check: venv
	$(PY) -m phalanx.contract.proto check proto

lint: venv
	$(VENV)/bin/ruff check libs services tests bench examples
	$(VENV)/bin/ruff format --check libs services bench examples

typecheck: venv
	$(VENV)/bin/mypy libs services bench examples

corpus: venv
	$(PY) -m examples.corpus

clean:
	rm -rf .phalanx build *.egg-info .pytest_cache .mypy_cache .ruff_cache
