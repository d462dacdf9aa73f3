"""An install the setup scripts did not smoke-check is not taken for a finished one: the
tests then install (or skip) instead of starting a binary that may crash on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from smetric.testing.engines import find_llama_cpp, find_vllm


@pytest.fixture
def engines_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SMETRIC_ENGINES_DIR", str(tmp_path))
    return tmp_path


def test_llama_cpp_build_counts_only_once_verified(engines_dir: Path) -> None:
    folder = engines_dir / "llama-cpp"
    folder.mkdir()
    (folder / "llama-server").write_bytes(b"")
    (folder / "smollm2.gguf").write_bytes(b"")
    assert find_llama_cpp() is None
    (folder / ".verified").touch()
    found = find_llama_cpp()
    assert found is not None and found.server == folder / "llama-server"


def test_vllm_install_counts_only_once_verified(engines_dir: Path) -> None:
    venv, model = engines_dir / "vllm-venv", engines_dir / "smollm2-135m-instruct"
    venv.mkdir()
    model.mkdir()
    (venv / ".installed").touch()
    (model / ".converted").touch()
    assert find_vllm() is None
    (venv / ".verified").touch()
    found = find_vllm()
    assert found is not None and found.model == model
