from pathlib import Path

import pytest
from lloyal.models import default_model_path, model_path


def test_both_test_models_are_gguf_files() -> None:
    for name in ("smollm2", "gemma3"):
        path = model_path(name)
        assert path.is_file()
        assert path.read_bytes()[:4] == b"GGUF"


def test_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "x.gguf"
    monkeypatch.setenv("LLOYAL_TEST_MODEL", str(fake))
    model_path.cache_clear()
    try:
        assert default_model_path() == fake
    finally:
        model_path.cache_clear()


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        model_path("nope")
