"""lloyal.hub and `lloyal pull` against a fake hub on 127.0.0.1
(tests/_fakehub.py): no model and no network needed. The transfer is
huggingface_hub's; these tests hold what lloyal adds or promises: the spec
syntax, the HF cache layout, the checks, offline use, and a hostile hub
confined."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lloyal import cli
from lloyal import hub as lloyal_hub
from lloyal.errors import ChecksumMismatchError, PullError, PullNotFoundError
from lloyal.hub import pull, resolve_model

pytest.importorskip("huggingface_hub")

from tests._fakehub import COMMIT, FakeHub

REPO = "org/tiny-GGUF"
FOLDER = "models--org--tiny-GGUF"


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
    """The Hugging Face cache (``hf:`` pulls); URL pulls go to ``cache/url``."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LLOYAL_CACHE_DIR", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hf"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return root


def snapshot(cache: Path) -> Path:
    return cache / "hf" / FOLDER / "snapshots" / COMMIT


def stored(cache: Path) -> list[str]:
    """Every file and link in the repository's cache folder, but locks."""
    folder = cache / "hf" / FOLDER
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if (p.is_file() or p.is_symlink()) and ".lock" not in p.name
    )


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
    # The standard HF cache: a snapshot link to a blob named by its SHA-256.
    assert path == snapshot(cache) / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == files["tiny-Q4_K_M.gguf"]
    sha = hashlib.sha256(files["tiny-Q4_K_M.gguf"]).hexdigest()
    assert path.resolve() == (cache / "hf" / FOLDER / "blobs" / sha).resolve()
    assert (cache / "hf" / FOLDER / "refs" / "main").read_text() == COMMIT
    assert not [p for p in stored(cache) if "incomplete" in p]
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
    hub: FakeHub, files: dict[str, bytes], cache: Path, spec: str, expected: str
) -> None:
    path = pull(spec)
    assert path.name == expected
    assert path.read_bytes() == files[expected]
    revision = "v1" if "@v1" in spec else "main"
    assert (cache / "hf" / FOLDER / "refs" / revision).read_text() == COMMIT
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
    assert not hub.cdn_gets()


def test_a_cut_download_is_tried_again(hub: FakeHub, files: dict[str, bytes]) -> None:
    # The hub's client tries again (with a Range from the last whole read of
    # 10 MiB, so here from the start) and the bytes are checked as ever.
    hub.cut_after = 1234
    path = pull(f"hf:{REPO}:Q8_0")
    assert path.read_bytes() == files["tiny-Q8_0.gguf"]
    assert len(hub.cdn_gets()) == 2


def test_a_checksum_mismatch_is_refused_and_nothing_kept(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    hub.wrong_sha = True
    with pytest.raises(ChecksumMismatchError, match="SHA-256"):
        pull(f"hf:{REPO}:Q8_0")
    assert [p for p in stored(cache) if not p.startswith("refs/")] == []
    # ... also for an exact file.
    with pytest.raises(ChecksumMismatchError):
        pull(f"hf:{REPO}/tiny-Q8_0.gguf")
    assert [p for p in stored(cache) if not p.startswith("refs/")] == []


def test_a_cached_file_is_not_downloaded_again(hub: FakeHub, files: dict[str, bytes]) -> None:
    for spec in (f"hf:{REPO}:Q8_0", f"hf:{REPO}/tiny-Q4_K.gguf"):
        first = pull(spec)
        hub.requests.clear()
        assert pull(spec) == first
        assert not hub.cdn_gets(), spec
    hub.add("plain", "x.gguf", b"plain")
    url = f"{hub.url}/cdn/plain/x.gguf"
    first = pull(url)
    hub.requests.clear()
    assert pull(url) == first
    assert not hub.requests


def test_a_model_another_tool_fetched_is_found(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    import huggingface_hub

    theirs = huggingface_hub.hf_hub_download(
        REPO, "tiny-Q8_0.gguf", cache_dir=cache / "hf", endpoint=hub.url
    )
    hub.requests.clear()
    assert pull(f"hf:{REPO}:Q8_0") == Path(theirs)
    assert not hub.cdn_gets()


def test_a_second_process_finds_it_offline(hub: FakeHub, files: dict[str, bytes]) -> None:
    path = pull(f"hf:{REPO}:Q8_0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    hub.requests.clear()
    done = subprocess.run(
        [sys.executable, "-m", "lloyal", "pull", f"hf:{REPO}:Q8_0", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == path
    assert not hub.requests
    # Offline, what the cache lacks is not found, and says why.
    env["HF_ENDPOINT"] = hub.url
    done = subprocess.run(
        [sys.executable, "-m", "lloyal", "pull", f"hf:{REPO}:Q4_K", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "offline" in done.stderr
    assert not hub.requests


def test_an_unreachable_hub_falls_back_to_the_cache(
    hub: FakeHub, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = pull(f"hf:{REPO}:Q8_0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    assert pull(f"hf:{REPO}:Q8_0") == path
    with pytest.raises(PullError, match="cannot reach") as e:
        pull(f"hf:{REPO}:Q4_K")
    assert not isinstance(e.value, PullNotFoundError)


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


def url_part(hub: FakeHub, cache: Path, data: bytes) -> tuple[str, Path]:
    """A URL of ``data`` with its SHA-256, and where its ``.part`` goes."""
    hub.add("plain", "m.gguf", data)
    url = f"{hub.url}/cdn/plain/m.gguf#sha256={hashlib.sha256(data).hexdigest()}"
    key = hashlib.sha256(url.encode()).hexdigest()
    return url, cache / "url" / key / "m.gguf.part"


def test_a_url_part_left_by_an_earlier_pull_is_resumed(hub: FakeHub, cache: Path) -> None:
    data = blob(6000)
    url, part = url_part(hub, cache, data)
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:2000])
    assert pull(url).read_bytes() == data
    assert [h.get("Range") for h in hub.cdn_gets()] == ["bytes=2000-"]
    assert not part.exists()


def test_a_server_that_ignores_range_restarts_from_zero(hub: FakeHub, cache: Path) -> None:
    data = blob(6000)
    url, part = url_part(hub, cache, data)
    hub.ignore_range = True
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:2000])
    assert pull(url).read_bytes() == data


def test_a_stale_part_of_other_bytes_is_pulled_again_from_zero(hub: FakeHub, cache: Path) -> None:
    data = blob(6000)
    url, part = url_part(hub, cache, data)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 2000)
    assert pull(url).read_bytes() == data
    assert [h.get("Range") for h in hub.cdn_gets()] == ["bytes=2000-", None]


def test_not_found_is_typed(hub: FakeHub, files: dict[str, bytes]) -> None:
    with pytest.raises(PullNotFoundError, match="404"):
        pull("hf:org/no-such-repo")
    with pytest.raises(PullNotFoundError, match="not found"):
        pull(f"hf:{REPO}/no-such-file.gguf")
    with pytest.raises(PullNotFoundError):
        pull(f"{hub.url}/cdn/nothing.gguf")


def test_the_token_goes_to_the_hub_only(
    hub: FakeHub, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    pull(f"hf:{REPO}:Q8_0")
    for _, path, headers in hub.requests:
        sent = headers.get("Authorization") or headers.get("authorization")
        assert sent == (None if path.startswith("/cdn/") else "Bearer hf_secret"), path


@pytest.mark.parametrize(
    "spec",
    [
        "hf:org",
        "hf:org/repo:Q4 K",
        "hf:org/repo/../../etc/passwd",
        "hf:org/repo/a//b.gguf",
        "hf:org/repo@..",
        "hf:org/repo@.:Q8_0",
    ],
)
def test_bad_specs(cache: Path, spec: str) -> None:
    with pytest.raises(ValueError, match=r"hf:org|file path|revision"):
        pull(spec)
    assert not cache.exists()


# -- a hostile hub (issue 48): what it sends stays inside the cache -----------------


def test_a_revision_cannot_leave_the_repository(hub: FakeHub, files: dict[str, bytes], cache: Path):
    for revision in ("..", "../..", "refs/../../x", "a\\b"):
        with pytest.raises(ValueError, match="revision"):
            pull(f"hf:{REPO}:Q8_0", revision=revision)
    assert not cache.exists()
    assert not hub.requests
    # A branch name with a slash stays a ref in the repository's folder.
    pull(f"hf:{REPO}:Q8_0", revision="refs/pr/1")
    assert (cache / "hf" / FOLDER / "refs" / "refs" / "pr" / "1").read_text() == COMMIT


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("commit", "../../../../evil"),
        ("commit", "0123"),
        ("etag", "../../../../evil"),
        ("etag", "a/b"),
    ],
)
def test_commits_and_etags_that_are_not_names_are_refused(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, knob: str, value: str
) -> None:
    setattr(hub, knob, value)
    before = sorted(p for p in tmp_path.rglob("*") if "cache" not in p.parts)
    with pytest.raises(PullError, match="refused"):
        pull(f"hf:{REPO}:Q8_0")
    if knob == "commit":  # also on a 404: the hub's client notes it under the commit
        with pytest.raises(PullError, match="refused"):
            pull(f"hf:{REPO}/no-such-file.gguf")
    assert sorted(p for p in tmp_path.rglob("*") if "cache" not in p.parts) == before
    assert not list(tmp_path.rglob("evil"))
    assert not hub.cdn_gets()


@pytest.mark.skipif(sys.platform == "win32", reason="links need privileges on Windows")
def test_links_the_cache_did_not_make_are_not_followed(
    hub: FakeHub, files: dict[str, bytes], cache: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    data = files["tiny-Q8_0.gguf"]
    sha = hashlib.sha256(data).hexdigest()
    for planted in (
        cache / "hf" / FOLDER / "blobs" / sha,
        snapshot(cache) / "tiny-Q8_0.gguf",
    ):
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.symlink_to(victim)
        with pytest.raises(PullError, match="outside the cache"):
            pull(f"hf:{REPO}:Q8_0")
        assert victim.read_bytes() == b"precious"
        planted.unlink(missing_ok=True)
    assert pull(f"hf:{REPO}:Q8_0").read_bytes() == data
    # A URL's final name and its .part: replaced, never written through.
    url, part = url_part(hub, cache, blob(6000))
    dest = part.with_name("m.gguf")
    dest.parent.mkdir(parents=True)
    part.symlink_to(victim)
    dest.symlink_to(victim)
    dest.with_name("m.gguf.pulled.json").write_text(json.dumps({"size": 8}))
    assert pull(url).read_bytes() == blob(6000)
    assert not dest.is_symlink()
    assert victim.read_bytes() == b"precious"


def test_a_body_past_the_listed_size_is_cut_off(
    hub: FakeHub, files: dict[str, bytes], cache: Path
) -> None:
    hub.endless = True
    with pytest.raises(PullError, match="past the listed 6,000 bytes"):
        pull(f"hf:{REPO}:Q8_0")
    # One read of the hub's client (10 MiB) past the size at most, not 512 MiB.
    assert hub.sent < 64 << 20
    assert [p for p in stored(cache) if not p.startswith("refs/")] == []


def test_a_listing_that_never_ends_is_refused(
    hub: FakeHub, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.self_link = True
    with pytest.raises(PullError, match="repeats or runs on"):
        pull(f"hf:{REPO}:Q8_0")
    assert sum("/tree/" in p for _, p, _ in hub.requests) == 2
    hub.self_link, hub.empty_pages = False, True
    monkeypatch.setattr(lloyal_hub, "_MAX_PAGES", 20)
    hub.requests.clear()
    with pytest.raises(PullError, match="runs on"):
        pull(f"hf:{REPO}:Q8_0")
    assert sum("/tree/" in p for _, p, _ in hub.requests) == 20
    assert not hub.cdn_gets()


def test_resolve_model_keeps_local_paths(tmp_path: Path) -> None:
    assert resolve_model(tmp_path / "m.gguf") == tmp_path / "m.gguf"
    assert resolve_model("relative/m.gguf") == Path("relative/m.gguf")
    assert resolve_model(os.fsdecode(tmp_path)) == tmp_path


def test_cli_pull_prints_the_path(
    hub: FakeHub, files: dict[str, bytes], cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["pull", f"hf:{REPO}:Q8_0", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()).read_bytes() == files["tiny-Q8_0.gguf"]
    assert err == ""
    assert cli.main(["pull", f"hf:{REPO}", "--revision", "v2"]) == 0
    assert Path(capsys.readouterr().out.strip()).parent.name == COMMIT
    assert (cache / "hf" / FOLDER / "refs" / "v2").is_file()
    assert cli.main(["pull", f"hf:{REPO}:IQ1_S"]) == 1
    assert "lloyal: error:" in capsys.readouterr().err


def test_cli_models_take_hub_specs(hub: FakeHub, files: dict[str, bytes]) -> None:
    # Every --model goes through cli._model; a bad file fails at load, not here.
    path = cli._model(f"hf:{REPO}:Q8_0")
    assert path.read_bytes() == files["tiny-Q8_0.gguf"]
    assert cli._model("local.gguf") == Path("local.gguf")


_PATHS = [
    "m-Q4_K_M.gguf",
    "sub/m-Q8_0.gguf",
    "../m-Q4_K_M.gguf",
    "a/../../m-Q4_K_M.gguf",
    "/abs-Q4_K_M.gguf",
    "x\\y-Q4_K_M.gguf",
    "",
    ".",
    "m-Q4_K_M-00001-of-00002.gguf",
    "n" * 300 + "-Q4_K_M.gguf",
]
_JUNK = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.lists(st.integers(), max_size=2)
)
_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["file", "directory"]) | _JUNK,
        "path": st.sampled_from(_PATHS) | _JUNK,
        "size": st.integers(-5, 10**12) | _JUNK,
        "lfs": st.fixed_dictionaries(
            {},
            optional={
                "oid": st.text("0123456789abcdef", min_size=64, max_size=64) | _JUNK,
                "size": st.integers(-5, 10**12) | _JUNK,
            },
        )
        | _JUNK,
    },
)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tree=st.lists(_ENTRY, max_size=6).map(json.dumps).map(str.encode)
    | st.binary(max_size=40)
    | st.just(b'{"not": "a list"}'),
    commit=st.sampled_from([COMMIT, "../../x", "", "0" * 39, "g" * 40]),
    etag=st.sampled_from([None, "../../y", "a b", "W/" + "1" * 64]),
)
def test_fuzzed_hub_answers_give_a_file_in_the_cache_or_a_pull_error(
    hub: FakeHub, cache: Path, tmp_path: Path, tree: bytes, commit: str, etag: str | None
) -> None:
    """Any file list, commit and ETag the hub sends (issue 48's fuzz of hub
    responses): the pull gives a file inside the cache or raises a
    PullError, and writes nothing outside the cache."""
    shutil.rmtree(cache, ignore_errors=True)  # each example from an empty cache
    hub.add("org/fuzz", "m-Q4_K_M.gguf", b"model bytes")
    hub.tree_body, hub.commit, hub.etag = tree, commit, etag
    outside = tmp_path / "outside"
    before = sorted(p for p in tmp_path.rglob("*") if cache not in p.parents and p != cache)
    try:
        path = pull("hf:org/fuzz")
    except PullError:
        pass
    else:
        assert (cache / "hf").resolve() in path.resolve().parents
    after = sorted(p for p in tmp_path.rglob("*") if cache not in p.parents and p != cache)
    assert after == before
    assert not outside.exists()
