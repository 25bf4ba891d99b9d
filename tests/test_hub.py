"""lloyal.hub and `lloyal pull` against a fake hub on 127.0.0.1
(tests/_fakehub.py): no model and no network needed."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from lloyal import cli
from lloyal.errors import ChecksumMismatchError, PullError, PullNotFoundError
from lloyal.hub import pull, resolve_model

from tests._fakehub import COMMIT, FakeHub

REPO = "org/tiny-GGUF"


def blob(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ at every offset (a resume from the wrong one shows)."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LLOYAL_CACHE_DIR", str(root))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return root


@pytest.fixture
def hub(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    fake.close()


@pytest.fixture
def files(hub: FakeHub) -> dict[str, bytes]:
    """A repository as bartowski's look: quants, a projector, a README."""
    return {
        name: hub.add(REPO, name, blob(size, seed))
        for seed, (name, size) in enumerate(
            [
                ("README.md", 100),
                ("mmproj-tiny-Q4_K_M.gguf", 3000),
                ("tiny-Q4_K.gguf", 4000),
                ("tiny-Q4_K_M.gguf", 5000),
                ("tiny-Q8_0.gguf", 6000),
                ("tiny-UD-Q8_0.gguf", 7000),
            ]
        )
    }


def test_pull_downloads_checks_and_caches(hub: FakeHub, files: dict[str, bytes], cache: Path):
    path = pull(f"hf:{REPO}")
    assert path == cache / "hub" / REPO / "main" / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == files["tiny-Q4_K_M.gguf"]
    record = json.loads(path.with_name(path.name + ".pulled.json").read_text())
    assert record["sha256"] == hashlib.sha256(files["tiny-Q4_K_M.gguf"]).hexdigest()
    assert record["checked"] is True
    assert record["commit"] == COMMIT
    assert not list(path.parent.glob("*.part"))
    # The tree came in pages (Link: rel="next"), one request for the bytes.
    assert sum("/tree/" in p for _, p, _ in hub.requests) == 3
    assert len(hub.cdn_gets()) == 1


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (f"hf:{REPO}", "tiny-Q4_K_M.gguf"),  # the default quantization
        (f"hf:{REPO}:q8_0", "tiny-Q8_0.gguf"),  # any case; the shortest of two matches
        (f"hf:{REPO}:Q4_K", "tiny-Q4_K.gguf"),  # the whole tag, not Q4_K_M
        (f"hf:{REPO}:UD-Q8_0", "tiny-UD-Q8_0.gguf"),
        (f"hf:{REPO}@v1:Q8_0", "tiny-Q8_0.gguf"),
        (f"hf:{REPO}/tiny-UD-Q8_0.gguf", "tiny-UD-Q8_0.gguf"),  # an exact file
    ],
)
def test_the_file_a_spec_picks(
    hub: FakeHub, files: dict[str, bytes], spec: str, expected: str
) -> None:
    path = pull(spec)
    assert path.name == expected
    assert path.read_bytes() == files[expected]
    revision = "v1" if "@v1" in spec else "main"
    assert path.parent.name == revision
    assert any(f"/resolve/{revision}/{expected}" in p for _, p, _ in hub.requests)


def test_no_quantization_tag_takes_the_first_gguf_but_no_projector(hub: FakeHub) -> None:
    hub.add(REPO, "mmproj-a.gguf", b"p")
    hub.add(REPO, "b-F16.gguf", b"f16")
    hub.add(REPO, "c-Q2_K.gguf", b"q2")
    assert pull(f"hf:{REPO}").name == "b-F16.gguf"


def test_no_match_lists_the_files(hub: FakeHub, files: dict[str, bytes]) -> None:
    with pytest.raises(PullNotFoundError, match="matching 'IQ2_XS'") as e:
        pull(f"hf:{REPO}:IQ2_XS")
    assert "tiny-Q8_0.gguf" in str(e.value)
    assert "README" not in str(e.value)
    assert not hub.cdn_gets()


def test_a_split_model_comes_whole(hub: FakeHub) -> None:
    parts = [hub.add(REPO, f"big-Q4_K_M-0000{i}-of-00003.gguf", blob(900, i)) for i in (1, 2, 3)]
    path = pull(f"hf:{REPO}")
    assert path.name == "big-Q4_K_M-00001-of-00003.gguf"
    for i, data in enumerate(parts, start=1):
        assert path.with_name(f"big-Q4_K_M-0000{i}-of-00003.gguf").read_bytes() == data
    hub.requests.clear()
    assert pull(f"hf:{REPO}") == path
    assert not hub.requests


def test_a_cut_download_resumes_with_range(hub: FakeHub, files: dict[str, bytes]) -> None:
    hub.cut_after = 1234
    path = pull(f"hf:{REPO}:Q8_0")
    assert path.read_bytes() == files["tiny-Q8_0.gguf"]
    first, second = hub.cdn_gets()
    assert "Range" not in first
    assert second["Range"] == "bytes=1234-"


def test_a_part_left_by_an_earlier_pull_is_resumed(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    data = files["tiny-Q8_0.gguf"]
    part = cache / "hub" / REPO / "main" / "tiny-Q8_0.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:2000])
    path = pull(f"hf:{REPO}:Q8_0")
    assert path.read_bytes() == data
    assert [h.get("Range") for h in hub.cdn_gets()] == ["bytes=2000-"]
    assert not part.exists()


def test_a_server_that_ignores_range_restarts_from_zero(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    hub.ignore_range = True
    part = cache / "hub" / REPO / "main" / "tiny-Q8_0.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(files["tiny-Q8_0.gguf"][:2000])
    assert pull(f"hf:{REPO}:Q8_0").read_bytes() == files["tiny-Q8_0.gguf"]


def test_a_stale_part_of_other_bytes_is_pulled_again_from_zero(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    part = cache / "hub" / REPO / "main" / "tiny-Q8_0.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 2000)
    assert pull(f"hf:{REPO}:Q8_0").read_bytes() == files["tiny-Q8_0.gguf"]
    assert [h.get("Range") for h in hub.cdn_gets()] == ["bytes=2000-", None]


def test_a_checksum_mismatch_is_refused_and_nothing_kept(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    hub.wrong_sha = True
    with pytest.raises(ChecksumMismatchError, match="SHA-256"):
        pull(f"hf:{REPO}:Q8_0")
    folder = cache / "hub" / REPO / "main"
    assert sorted(p.name for p in folder.iterdir()) == []
    # ... also for an exact file, checked by the redirect's X-Linked-Etag.
    with pytest.raises(ChecksumMismatchError):
        pull(f"hf:{REPO}/tiny-Q8_0.gguf")
    assert sorted(p.name for p in folder.iterdir()) == []


def test_a_cached_file_needs_no_request(hub: FakeHub, files: dict[str, bytes]) -> None:
    hub.add("plain", "x.gguf", b"plain")
    for spec in (f"hf:{REPO}:Q8_0", f"hf:{REPO}/tiny-Q4_K.gguf", f"{hub.url}/cdn/plain/x.gguf"):
        first = pull(spec)
        hub.requests.clear()
        assert pull(spec) == first
        assert not hub.requests, spec


def test_a_file_renamed_but_not_recorded_is_checked_not_downloaded(
    hub: FakeHub, files: dict[str, bytes]
) -> None:
    path = pull(f"hf:{REPO}:Q8_0")
    path.with_name(path.name + ".pulled.json").unlink()
    hub.requests.clear()
    assert pull(f"hf:{REPO}:Q8_0") == path
    assert not hub.cdn_gets()
    assert path.with_name(path.name + ".pulled.json").is_file()


def test_a_plain_url_with_a_sha256_fragment(hub: FakeHub, cache: Path) -> None:
    data = hub.add("plain", "some model.gguf", blob(3000))
    url = f"{hub.url}/cdn/plain/some%20model.gguf"
    good = hashlib.sha256(data).hexdigest()
    path = pull(f"{url}#sha256={good.upper()}")
    assert path.name == "some model.gguf"
    assert path.parent.parent == cache / "url"
    assert path.read_bytes() == data
    with pytest.raises(ChecksumMismatchError):
        pull(f"{url}#sha256={'0' * 64}")
    with pytest.raises(ValueError, match="sha256"):
        pull(f"{url}#md5=abc")
    # Without a fragment it is kept, its SHA-256 recorded but not checked.
    path = pull(url)
    assert json.loads(path.with_name(path.name + ".pulled.json").read_text())["checked"] is False


def test_not_found_is_typed(hub: FakeHub, files: dict[str, bytes]) -> None:
    with pytest.raises(PullNotFoundError, match="not found"):
        pull("hf:org/no-such-repo")
    with pytest.raises(PullNotFoundError, match="Entry not found"):
        pull(f"hf:{REPO}/no-such-file.gguf")
    with pytest.raises(PullNotFoundError):
        pull(f"{hub.url}/cdn/nothing.gguf")


def test_a_network_error_is_a_pull_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    with pytest.raises(PullError, match="cannot reach") as e:
        pull(f"hf:{REPO}")
    assert not isinstance(e.value, PullNotFoundError)


def test_the_token_goes_to_the_hub_only(
    hub: FakeHub, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.cdn_host = "localhost"
    pull(f"hf:{REPO}:Q8_0")
    for _, path, headers in hub.requests:
        sent = headers.get("Authorization")
        assert sent == (None if path.startswith("/cdn/") else "Bearer hf_secret"), path


@pytest.mark.parametrize(
    "spec",
    ["hf:org", "hf:org/repo:Q4 K", "hf:org/repo/../../etc/passwd", "hf:org/repo/a//b.gguf"],
)
def test_bad_specs(cache: Path, spec: str) -> None:
    with pytest.raises(ValueError, match=r"hf:org|file path"):
        pull(spec)


def test_resolve_model_keeps_local_paths(tmp_path: Path) -> None:
    assert resolve_model(tmp_path / "m.gguf") == tmp_path / "m.gguf"
    assert resolve_model("relative/m.gguf") == Path("relative/m.gguf")
    assert resolve_model(os.fsdecode(tmp_path)) == tmp_path


def test_cli_pull_prints_the_path(
    hub: FakeHub, files: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", f"hf:{REPO}:Q8_0", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()).read_bytes() == files["tiny-Q8_0.gguf"]
    assert err == ""
    assert cli.main(["pull", f"hf:{REPO}", "--revision", "v2"]) == 0
    assert Path(capsys.readouterr().out.strip()).parent.name == "v2"
    assert cli.main(["pull", f"hf:{REPO}:IQ1_S"]) == 1
    assert "lloyal: error:" in capsys.readouterr().err


def test_cli_models_take_hub_specs(hub: FakeHub, files: dict[str, bytes]) -> None:
    # Every --model goes through cli._model; a bad file fails at load, not here.
    path = cli._model(f"hf:{REPO}:Q8_0")
    assert path.read_bytes() == files["tiny-Q8_0.gguf"]
    assert cli._model("local.gguf") == Path("local.gguf")
