"""Phase 0 fixtures: the real Qwen3 tokenizer files, fetched once per machine."""

from pathlib import Path

import pytest

from tests import assets


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return assets.qwen3_tokenizer_dir()
