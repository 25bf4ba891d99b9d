"""`lloyal serve --api-key ... --api-key-file ...` (and LLOYAL_API_KEY):
every route but /health wants a key, as OpenAI's and Anthropic's clients
send one; and TLS with --ssl-keyfile / --ssl-certfile."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lloyal.server import ServerConfig

from tests._hang import HANG_GUARD_S, deadline
from tests.server_fuzz import _free_port, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# the team's key\nfrom-file\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLOYAL_API_KEY", "from-env")
    try:
        proc, url = start_server(
            "--n-seq-max", "2", "--n-ctx", "512", "--api-key", "secret",
            "--api-key-file", str(keys),
        )  # fmt: skip
    finally:
        mp.undo()
    yield url
    stop_server(proc)


def test_every_route_but_health_wants_a_key(server: str) -> None:
    assert httpx.get(f"{server}/health", timeout=HANG_GUARD_S).status_code == 200
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for method, path, json in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", body),
        ("POST", "/tokenize", {"content": "Hi"}),
        ("GET", "/metrics", None),
        ("GET", "/no-such-route", None),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "secre"}):
            r = httpx.request(
                method, f"{server}{path}", json=json, headers=headers, timeout=HANG_GUARD_S
            )
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    # Anthropic's routes answer in Anthropic's body.
    r = httpx.post(
        f"{server}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=HANG_GUARD_S
    )
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"
    for headers in (
        {"Authorization": "Bearer secret"},
        {"authorization": "bearer from-file"},
        {"x-api-key": "from-env"},
    ):
        r = httpx.post(
            f"{server}/v1/chat/completions", json=body, headers=headers, timeout=HANG_GUARD_S
        )
        assert r.status_code == 200, headers


def test_the_openai_client_with_and_without_the_key(server: str) -> None:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="secret", max_retries=0) as ok:
        assert ok.models.list().data
    with (
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()


def test_a_bad_key_file_is_refused_at_startup(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    for args in (["--api-key-file", str(empty)], ["--api-key-file", str(tmp_path / "gone")]):
        r = subprocess.run(
            [sys.executable, "-m", "lloyal", "serve", *args],
            capture_output=True,
            timeout=HANG_GUARD_S,
        )
        assert r.returncode == 2, r.stderr
        assert b"error" in r.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lloyal", "serve", "--port", str(port), "--n-seq-max", "1",
         "--n-ctx", "256", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"https://127.0.0.1:{port}"
        trust = ssl.create_default_context(cafile=str(cert))
        # A hang guard, not a speed check: startup loads the model.
        give_up = deadline()
        while True:
            try:
                # One probe's limit only ends a probe the server is too busy
                # to answer; the next one follows. The deadline is the guard.
                r = httpx.get(f"{url}/health", verify=trust, timeout=5)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, "the server died at startup"
                assert time.monotonic() < give_up, "the server did not start (hang guard)"
                time.sleep(0.2)
        assert r.status_code == 200
        # Plain HTTP gets no answer: a dropped connection, or (on a machine
        # too busy to drop it in 5 s) none at all. Either way an HTTPError.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        stop_server(proc)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cors_only_for_the_origins_allowed(smollm2: Path) -> None:
    """``--cors-origin`` lets a browser page of that origin call the server
    (its preflight answered before the key check, which a preflight cannot
    pass); other origins get no CORS headers; without the flag a preflight
    is a 405 as before."""
    from tests._asgi import in_process

    preflight = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    config = ServerConfig(
        model_path=smollm2,
        n_ctx=256,
        n_seq_max=2,
        api_keys=("k",),
        cors_origins=("http://app.example",),
    )
    async with in_process(config) as (client, _):
        r = await client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        r = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"Origin": "http://app.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = await client.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert "access-control-allow-origin" not in r.headers
    async with in_process(ServerConfig(model_path=smollm2, n_ctx=256, n_seq_max=2)) as (c, _):
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 405
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_non_ascii_key_matches_what_a_client_sends(smollm2: Path) -> None:
    """A key with non-ASCII characters matches the UTF-8 bytes a client
    sends in ``Authorization`` or ``x-api-key`` (it was accepted at startup
    and then never matched)."""
    from tests._asgi import in_process

    key = "clé-ключ-鍵"
    config = ServerConfig(model_path=smollm2, n_ctx=256, n_seq_max=2, api_keys=(key,))
    async with in_process(config) as (client, _):
        sent = key.encode("utf-8")
        for headers in ({"Authorization": b"Bearer " + sent}, {"x-api-key": sent}):
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 200, headers
        r = await client.get("/v1/models", headers={"x-api-key": sent[:-1]})
        assert r.status_code == 401
