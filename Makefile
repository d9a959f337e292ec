# rankscope: `make demo` runs the main job, `make test` runs every test.
# Both bootstrap what they need: a project-local venv with the pinned torch
# (libtorch for tch, and the real torchrun) and the DuckDB CLI.

SHELL := /bin/bash
VENV := .venv
TORCH_VERSION := 2.13.0
DUCKDB_VERSION := 1.5.6
PYTHON ?= python3
STAMP := $(VENV)/.rankscope-$(TORCH_VERSION)-$(DUCKDB_VERSION)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help setup demo test lint bench fmt collector clean

help: ## show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP):
	@command -v c++ >/dev/null || { echo "installing a C++ compiler (tch builds C++)"; \
	  (command -v sudo >/dev/null && sudo apt-get install -y g++ || apt-get install -y g++); }
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { echo "installing python3-venv"; \
	  (command -v sudo >/dev/null && sudo apt-get install -y python3-venv || apt-get install -y python3-venv); }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION) duckdb-cli==$(DUCKDB_VERSION)
	@# A fixed path to libtorch, whatever the python version (see .cargo/config.toml).
	ln -sfn "$$($(VENV)/bin/python -W ignore -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch
	@touch $@

setup: $(STAMP) ## create the venv (torch, torchrun, duckdb)

demo: setup ## train 4 ranks into an embedded collector and summarise the run
	cargo run --release -p rankscope -- demo

test: setup ## build everything and run every test
	cargo build --workspace --bins
	cargo test --workspace --no-fail-fast

lint: setup ## rustfmt and clippy, as CI wants them
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all

bench: setup ## overhead benchmarks, printed and saved to bench-latest.md (see BENCHMARKS.md)
	cargo run --release -p rankscope -- bench | tee bench-latest.md

collector: ## a collector-only binary, without libtorch
	cargo build --release -p rankscope --no-default-features

clean:
	cargo clean
