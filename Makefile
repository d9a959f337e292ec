# rankscope: `make demo` runs the main job, `make test` runs every test.
# Both bootstrap what they need: a project-local venv with the pinned torch
# (libtorch for tch, and the real torchrun) and the DuckDB CLI.

SHELL := /bin/bash
VENV := .venv
# The torch of this venv: the libtorch that tch (the Rust training programs,
# `rankscope train`) compiles against, and the real torchrun.
TORCH_VERSION := 2.13.0
# The Python package links no libtorch: its wheel is tested beside the oldest and
# the newest torch it supports (python/tests/test_wheel.py), and requires the
# oldest as a floor (python/pyproject.toml, rankscope/__init__.py).
TORCH_FLOOR := 2.11.0
TORCH_NEWEST := 2.15.0
# `make wheel`'s manylinux build: zig links against an older glibc.
ZIGLANG_VERSION := 0.17.0
CARGO_ZIGBUILD_VERSION := 0.24.0
AUDITWHEEL_VERSION := 6.8.2
MANYLINUX := 2_28
DUCKDB_VERSION := 1.5.6
MATURIN_VERSION := 1.16.0
PYTEST_VERSION := 8.4.2
# numpy only so that `import torch` does not warn "Failed to initialize NumPy".
NUMPY_VERSION := 2.3.5
# A local S3 server for the Delta tests (tests/tests/delta.rs); its put-if-absent
# holds under racing writers.
MOTO_VERSION := 5.2.5
# The Python delta-rs reader: the Delta tests check that it reads our tables.
DELTALAKE_PY_VERSION := 1.6.6
# DuckDB's delta and httpfs extensions load only into their exact DuckDB
# version, and PyPI has them for 1.5.5, not for DUCKDB_VERSION: the Delta tests
# read with this DuckDB, installed beside the main one (docs/past-one-machine.md).
DUCKDB_DELTA_VERSION := 1.5.5
DELTA_READERS := $(VENV)/delta-readers
# The frameworks of rankscope.integrations, for their tests (python/tests/test_integrations.py)
# and python/benches/integrations_ab.py; the package itself requires none of them.
TRANSFORMERS_VERSION := 5.24.0
LIGHTNING_VERSION := 2.6.6
ACCELERATE_VERSION := 1.15.0
PYTHON ?= python3
STAMP := $(VENV)/.rankscope-$(TORCH_VERSION)-$(DUCKDB_VERSION)-$(MATURIN_VERSION)-$(PYTEST_VERSION)-$(NUMPY_VERSION)-$(MOTO_VERSION)-$(DELTALAKE_PY_VERSION)-$(TRANSFORMERS_VERSION)-$(LIGHTNING_VERSION)-$(ACCELERATE_VERSION)
# The wheel's `rankscope` command (a native binary, no libtorch) goes here before
# maturin packs it (python/pyproject.toml: tool.maturin.data).
WHEEL_DATA := python/wheel-data
# maturin builds into the main target directory: the extension and the binaries
# share their compiled dependencies (tokio, tonic, prost) and one profile.
MATURIN := cd python && CARGO_TARGET_DIR=$(CURDIR)/target maturin
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: disk-space help setup delta-readers python python-dev wheel wheel-local browser terminal demo test lint bench bench-sharding fmt collector clean

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
	  torch==$(TORCH_VERSION) duckdb-cli==$(DUCKDB_VERSION) maturin==$(MATURIN_VERSION) pytest==$(PYTEST_VERSION) \
	  numpy==$(NUMPY_VERSION) "moto[server]==$(MOTO_VERSION)" \
	  deltalake==$(DELTALAKE_PY_VERSION) transformers==$(TRANSFORMERS_VERSION) lightning==$(LIGHTNING_VERSION) \
	  accelerate==$(ACCELERATE_VERSION)
	@# A fixed path to libtorch, whatever the python version (see .cargo/config.toml).
	ln -sfn "$$($(VENV)/bin/python -W ignore -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch
	@touch $@

# DuckDB with the delta and httpfs extensions, for the Delta tests: the CLI at
# $(DELTA_READERS)/duckdb_cli/duckdb, each extension file inside its package.
$(DELTA_READERS)/.installed-$(DUCKDB_DELTA_VERSION): $(STAMP)
	rm -rf $(DELTA_READERS)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --target $(DELTA_READERS) \
	  duckdb-cli==$(DUCKDB_DELTA_VERSION) duckdb-extension-delta==$(DUCKDB_DELTA_VERSION) \
	  duckdb-extension-httpfs==$(DUCKDB_DELTA_VERSION)
	chmod +x $(DELTA_READERS)/duckdb_cli/duckdb
	@touch $@

delta-readers: $(DELTA_READERS)/.installed-$(DUCKDB_DELTA_VERSION)

setup: $(STAMP) python ## create the venv (torch, torchrun, duckdb) and install the Python package and command

# The `rankscope` command as the wheel ships it: the binary without libtorch
# (collector, report, demo, ...), which starts in milliseconds. $(1) is cargo's
# profile flag, $(2) its folder under target/. It is copied at once (stripped:
# symbols are most of its size): a later `cargo build` of the full binary (with
# `train` and `bench`) takes the same name.
define command-binary
	cargo build $(1) -p rankscope --no-default-features --features delta
	mkdir -p $(WHEEL_DATA)/scripts
	cp target/$(2)/rankscope $(WHEEL_DATA)/scripts/rankscope
	strip $(WHEEL_DATA)/scripts/rankscope
endef

# The package as a wheel: the extension (abi3, no libtorch) and the `rankscope`
# command. $(1) is maturin's profile flag, $(2) the folder under target/wheels.
# The venv installs this same wheel (not an editable build), as a user would.
define package-wheel
	rm -rf target/wheels/$(2)
	$(MATURIN) build $(1) --strip --compatibility linux --quiet --interpreter $(CURDIR)/$(VENV)/bin/python --out $(CURDIR)/target/wheels/$(2)
endef

# zig, cargo-zigbuild and auditwheel, for the manylinux wheel only.
ZIG_STAMP := $(VENV)/.zig-$(ZIGLANG_VERSION)-$(CARGO_ZIGBUILD_VERSION)-$(AUDITWHEEL_VERSION)
$(ZIG_STAMP): $(STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check \
	  ziglang==$(ZIGLANG_VERSION) cargo-zigbuild==$(CARGO_ZIGBUILD_VERSION) auditwheel==$(AUDITWHEEL_VERSION)
	@touch $@

# The wheel users install: one per platform, cp39-abi3 and manylinux_$(MANYLINUX)
# (zig links both the extension and the command against glibc 2.28), requiring
# torch>=$(TORCH_FLOOR) and installing beside whatever supported torch is there.
ZIG_TARGET := x86_64-unknown-linux-gnu.$(subst _,.,$(MANYLINUX))
# The most a user's wheel may weigh (40 MB): `make wheel` fails above it.
WHEEL_MAX_BYTES := 40000000
# The command is built with the `wheel` profile (Cargo.toml: for size, stripped),
# the extension with the release profile.
wheel: $(ZIG_STAMP) ## build the user's manylinux wheel into target/wheels/dist
	cargo zigbuild --profile wheel -p rankscope --no-default-features --features delta --target $(ZIG_TARGET)
	mkdir -p $(WHEEL_DATA)/scripts
	cp target/x86_64-unknown-linux-gnu/wheel/rankscope $(WHEEL_DATA)/scripts/rankscope
	rm -rf target/wheels/dist
	$(MATURIN) build --release --strip --zig --target x86_64-unknown-linux-gnu --compatibility manylinux_$(MANYLINUX) \
	  --quiet --interpreter $(CURDIR)/$(VENV)/bin/python --out $(CURDIR)/target/wheels/dist
	$(VENV)/bin/auditwheel show target/wheels/dist/rankscope-*.whl
	@ls -l target/wheels/dist/rankscope-*.whl
	@size=$$(stat -c %s target/wheels/dist/rankscope-*.whl); [ $$size -le $(WHEEL_MAX_BYTES) ] || \
	  { echo "the wheel is $$size bytes, over $(WHEEL_MAX_BYTES): see the wheel profile in Cargo.toml"; exit 1; }

# The package as this machine's venv uses it (`make setup`, `make demo`): the
# release build, linked for this machine's glibc.
wheel-local: $(STAMP)
	$(call command-binary,--release,release)
	$(call package-wheel,--release,release)

# The `rankscope` Python package (python/) and its `rankscope` command,
# installed into the venv beside its torch.
python: wheel-local ## build and install the rankscope package (and command) into .venv, release build
	$(VENV)/bin/pip install --quiet --no-deps --force-reinstall target/wheels/release/rankscope-*.whl

# The package as `make test` and `make demo` use it: the dev profile. `make python`
# installs the release build again.
python-dev: $(STAMP)
	$(call command-binary,,debug)
	$(call package-wheel,--profile dev,dev)
	$(VENV)/bin/pip install --quiet --no-deps --force-reinstall target/wheels/dev/rankscope-*.whl

# The demo runs on the dev build that `make test` uses too: it compiles in a quarter
# of the release build's time (BENCHMARKS.md, "Build and install times"), and a
# `make test` after it compiles nothing again. `make python` installs the release
# build for real runs.
demo: $(STAMP) python-dev ## 4 PyTorch DDP ranks under torchrun into an embedded collector, then the summary and report (dev build)
	$(VENV)/bin/rankscope demo --steps 100

# Headless Chromium, for the report's browser test (Debian's package).
browser:
	@command -v chromium >/dev/null || { echo "installing chromium (the report's browser test)"; \
	  (command -v sudo >/dev/null && S=sudo || S=; $$S apt-get update -qq && $$S apt-get install -y -qq chromium); }

# tmux, for `rankscope top`'s terminal test (Debian's package).
terminal:
	@command -v tmux >/dev/null || { echo "installing tmux (rankscope top's terminal test)"; \
	  (command -v sudo >/dev/null && S=sudo || S=; $$S apt-get update -qq && $$S apt-get install -y -qq tmux); }

# Free space that `make test` needs, in GiB, measured (BENCHMARKS.md, "Build and
# install times"): the venv with torch (6), the dev build in target/ (3, with
# the wheels), and the wheel test's own venvs under the temp folder (6: torch and
# what it requires take 4.6; one venv at a time, each removed when its tests end;
# the test checks this figure again). Checked before anything is built: a full disk otherwise fails the run
# half an hour in.
VENV_GIB := 6
TARGET_GIB := 3
USER_VENV_GIB := 6
disk-space:
	@tmp="$${TMPDIR:-/tmp}"; [ -d "$$tmp" ] || tmp=/tmp; \
	 need=0; [ -e $(STAMP) ] || need=$$((need + $(VENV_GIB))); [ -d target/debug ] || need=$$((need + $(TARGET_GIB))); \
	 here=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); there=$$(df -Pk "$$tmp" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	 if [ "$$(stat -c %d .)" = "$$(stat -c %d "$$tmp")" ]; then need=$$((need + $(USER_VENV_GIB))); tmp_need=0; else tmp_need=$(USER_VENV_GIB); fi; \
	 if [ "$$here" -lt "$$need" ] || [ "$$there" -lt "$$tmp_need" ]; then \
	   echo "make test needs about $$need GiB free on this disk ($$here GiB are)$$( [ $$tmp_need = 0 ] || echo " and $$tmp_need GiB under $$tmp ($$there GiB are)"):" >&2; \
	   echo "free some space (old pytest folders under $$tmp, stale builds with 'cargo clean') or set TMPDIR to a roomier disk" >&2; \
	   exit 1; fi

# The wheel test installs python-dev's wheel (the dev profile) into a fresh venv
# beside the oldest and then the newest supported torch, as a user would.
test: disk-space $(STAMP) python-dev browser terminal delta-readers ## build everything and run every test (installs the package's dev build)
	cargo build --workspace --bins
	cargo test --workspace --no-fail-fast
	RANKSCOPE_WHEEL="$$(ls target/wheels/dev/rankscope-*.whl)" RANKSCOPE_USER_VENV_GIB=$(USER_VENV_GIB) \
	  RANKSCOPE_TORCH_VERSIONS="$(TORCH_FLOOR) $(TORCH_NEWEST)" \
	  $(VENV)/bin/python -m pytest -q python/tests

lint: $(STAMP) ## rustfmt, clippy and rustdoc, warnings as errors (needs the venv's libtorch, not a build)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
	cd python && cargo fmt -- --check && CARGO_TARGET_DIR=$(CURDIR)/target cargo clippy --all-targets -- -D warnings

fmt:
	cargo fmt --all

bench: setup ## overhead and collector benchmarks, printed and saved to bench-latest.md (see BENCHMARKS.md)
	cargo run --release -p rankscope -- bench | tee bench-latest.md
	cargo build --release -p rankscope --no-default-features --features delta
	cp target/release/rankscope target/release/rankscope-collector
	cargo run --release -p rankscope -- bench collector --collector-bin target/release/rankscope-collector | tee -a bench-latest.md
	$(VENV)/bin/python python/benches/ddp_ab.py | tee -a bench-latest.md
	$(VENV)/bin/python python/benches/fsdp_ab.py | tee -a bench-latest.md
	$(VENV)/bin/python python/benches/integrations_ab.py | tee -a bench-latest.md

bench-sharding: ## throughput of 1 vs 2 collectors (see BENCHMARKS.md)
	cargo build --release -p rankscope --no-default-features --features delta
	python3 collector/benches/sharding.py --bin target/release/rankscope

collector: ## a collector-only binary, without libtorch (with Delta Lake output)
	cargo build --release -p rankscope --no-default-features --features delta

clean:
	cargo clean
	rm -rf $(WHEEL_DATA)
