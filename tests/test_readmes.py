"""The READMEs' commands run as typed from the repository root, without activating the venv:
each names the project's Python (`.venv/bin/python`, `.venv/bin/mini-vllm`), never whatever
`python`, `pytest` or `mini-vllm` comes first on the PATH."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = [
    ROOT / "README.md",
    ROOT / "benchmarks/README.md",
    *sorted(ROOT.glob("phase*/README.md")),
]
BARE = re.compile(r"^(python3?|pytest|pip|mini-vllm)(\s|$)")  # a command not from .venv/bin
INLINE_BARE = re.compile(r"^(python3?|pytest|pip)\s")  # `mini-vllm serve` in prose names it


def shell_lines(text: str):
    """(line number, command) for every line of a shell code block (fenced, not python, or
    indented), and every inline code span elsewhere."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip("`\n ")
            continue
        if fence is not None:
            if fence != "python":
                yield number, line.strip(), BARE
        elif line.startswith("    "):
            yield number, line.strip(), BARE
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span.strip(), INLINE_BARE


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_names_the_venv(readme):
    bare = [
        f"{readme.name}:{n}: {command}"
        for n, command, pattern in shell_lines(readme.read_text())
        if pattern.match(command)
    ]
    assert not bare, "run these through .venv/bin/:\n" + "\n".join(bare)


def test_the_check_sees_a_bare_command():
    text = "```bash\npython -m pytest tests/phase3\n```\nthen `pytest tests/phase4` and `mini-vllm`"
    found = [c for _, c, pattern in shell_lines(text) if pattern.match(c)]
    assert found == ["python -m pytest tests/phase3", "pytest tests/phase4"]
