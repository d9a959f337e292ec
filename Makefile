# rankscope: `make demo` runs the main job, `make test` runs every test.
# Both bootstrap what they need: a project-local venv with the pinned torch
# (libtorch for tch, and the real torchrun) and the DuckDB CLI.

SHELL := /bin/bash
VENV := .venv
TORCH_VERSION := 2.13.0
DUCKDB_VERSION := 1.5.6
MATURIN_VERSION := 1.16.0
PYTEST_VERSION := 8.4.2
PYTHON ?= python3
STAMP := $(VENV)/.rankscope-$(TORCH_VERSION)-$(DUCKDB_VERSION)-$(MATURIN_VERSION)-$(PYTEST_VERSION)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help setup python python-dev browser demo test lint bench bench-sharding fmt collector clean

help: ## show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP):
	@command -v c++ >/dev/null || { echo "installing a C++ compiler (tch builds C++)"; \
	  (command -v sudo >/dev/null && sudo apt-get install -y g++ || apt-get install -y g++); }
	@# The multi-node test (tests/tests/multinode.rs) makes network namespaces with `ip`;
	@# without it that test is skipped (loudly), so a failed install does not stop setup.
	@PATH="$$PATH:/usr/sbin:/sbin" command -v ip >/dev/null || { echo "installing iproute2 (the multi-node test uses ip netns)"; \
	  (command -v sudo >/dev/null && sudo apt-get install -y iproute2 || apt-get install -y iproute2) \
	  || echo "could not install iproute2: the multi-node test will be skipped"; }
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { echo "installing python3-venv"; \
	  (command -v sudo >/dev/null && sudo apt-get install -y python3-venv || apt-get install -y python3-venv); }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check \
	  torch==$(TORCH_VERSION) duckdb-cli==$(DUCKDB_VERSION) maturin==$(MATURIN_VERSION) pytest==$(PYTEST_VERSION)
	@# A fixed path to libtorch, whatever the python version (see .cargo/config.toml).
	ln -sfn "$$($(VENV)/bin/python -W ignore -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch
	@touch $@

setup: $(STAMP) python ## create the venv (torch, torchrun, duckdb) and install the Python package

# The `rankscope` Python package (agent/python), built against the venv's torch
# and installed into the venv. Cargo rebuilds only what changed.
python: $(STAMP) ## build and install the rankscope Python package into .venv
	cd agent/python && VIRTUAL_ENV=$(CURDIR)/$(VENV) maturin develop --release --quiet

# The package as `make test` uses it: the dev profile, built into the main
# workspace's target directory. Both workspaces resolve the same versions and
# features, so this build and `cargo test` compile the dependencies (DataFusion
# among them) once between them. `make python` installs the release build again.
python-dev: $(STAMP)
	cd agent/python && CARGO_TARGET_DIR=$(CURDIR)/target VIRTUAL_ENV=$(CURDIR)/$(VENV) maturin develop --quiet

demo: setup ## 4 PyTorch DDP ranks under torchrun into an embedded collector, then the summary and report
	cargo run --release -p rankscope -- demo --script agent/python/examples/ddp_train.py --steps 100

# Headless Chromium, for the report's browser test (Debian's package).
browser:
	@command -v chromium >/dev/null || { echo "installing chromium (the report's browser test)"; \
	  (command -v sudo >/dev/null && S=sudo || S=; $$S apt-get update -qq && $$S apt-get install -y -qq chromium); }

test: $(STAMP) python-dev browser ## build everything and run every test (installs the package's dev build)
	cargo build --workspace --bins
	cargo test --workspace --no-fail-fast
	$(VENV)/bin/python -m pytest -q agent/python/tests

lint: setup ## rustfmt and clippy, as CI wants them
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cd agent/python && cargo fmt -- --check && cargo clippy --all-targets -- -D warnings

fmt:
	cargo fmt --all

bench: setup ## overhead and collector benchmarks, printed and saved to bench-latest.md (see BENCHMARKS.md)
	cargo run --release -p rankscope -- bench | tee bench-latest.md
	cargo build --release -p rankscope --no-default-features
	cp target/release/rankscope target/release/rankscope-collector
	cargo run --release -p rankscope -- bench collector --collector-bin target/release/rankscope-collector | tee -a bench-latest.md
	$(VENV)/bin/python agent/python/benches/ddp_ab.py | tee -a bench-latest.md

bench-sharding: ## throughput of 1 vs 2 collectors (see BENCHMARKS.md)
	cargo build --release -p rankscope --no-default-features
	python3 collector/benches/sharding.py --bin target/release/rankscope

collector: ## a collector-only binary, without libtorch
	cargo build --release -p rankscope --no-default-features

clean:
	cargo clean
	cd agent/python && cargo clean
