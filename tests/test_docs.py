"""Documented commands still run: each entry point the docs show answers --help and knows the flags they give it.

Commands are read from README.md, docs/*.md and benchmarks/README.md (fenced code blocks and
inline code): `python -m MODULE`, `torchrun ... -m MODULE`, `python benchmarks/X.py` and
`bash scripts/X.sh`. Each entry point's --help runs once; every `--flag` written after it must
appear in that help. Relative links in the same files must point to existing files and headings.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# scripts/test.sh runs the whole gate: it has no --help of its own.
NOT_RUN = {("script", "scripts/test.sh")}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_ENTRY = re.compile(
    r"(?:^|[\s;(|&])(?:(?:\S*/)?python3?\s+-m\s+(?P<mod>[A-Za-z_][\w.]*)"
    r"|torchrun\b[^\n]*?\s-m\s+(?P<tmod>[A-Za-z_][\w.]*)"
    r"|(?:\S*/)?python3?\s+(?P<bench>benchmarks/\w+\.py)"
    r"|bash\s+(?P<script>scripts/\w+\.sh))"
)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# python -m of tools, not of this project
_FOREIGN = {"pip", "pytest", "venv", "torch.distributed.run"}


def _doc_texts() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in DOCS if path.exists()]


def _command_lines(text: str) -> list[str]:
    """Each command of a fenced block (continuation lines joined, comments cut) and each inline code span."""
    lines: list[str] = []
    for block in _FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [line.split("  #")[0].split(" # ")[0] for line in joined.splitlines()]
    prose = _FENCE.sub("", text)
    # inline code may wrap across a line break in prose
    lines += [m.group(1) for m in re.finditer(r"`([^`]+)`", prose)]
    return [" ".join(line.split()) for line in lines]


def documented_commands() -> dict[tuple[str, str], dict[str, set[str]]]:
    """(kind, target) -> {flag: the doc files that give it}."""
    found: dict[tuple[str, str], dict[str, set[str]]] = {}
    for path, text in _doc_texts():
        for line in _command_lines(text):
            matches = list(_ENTRY.finditer(line))
            for i, m in enumerate(matches):
                if m.group("mod") or m.group("tmod"):
                    key = ("module", m.group("mod") or m.group("tmod"))
                    if key[1] in _FOREIGN:
                        continue
                elif m.group("bench"):
                    key = ("benchmark", m.group("bench"))
                else:
                    key = ("script", m.group("script"))
                end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
                tail = line[m.end() : end]
                # a pipe or a second command ends this one's arguments
                tail = re.split(r"\s(?:\||&&|;)\s|`|\s(?:llama-\S+|pip|torchrun)\s", tail)[0]
                flags = found.setdefault(key, {})
                for flag in _FLAG.findall(tail):
                    flags.setdefault(flag, set()).add(str(path.relative_to(ROOT)))
    return found


COMMANDS = documented_commands()


@functools.cache
def help_text(kind: str, target: str) -> tuple[int, str]:
    if kind == "module":
        argv = [sys.executable, "-m", target, "--help"]
    elif kind == "benchmark":
        argv = [sys.executable, target, "--help"]
    else:
        argv = ["bash", target, "--help"]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv[1:])} did not finish in 180 s")
    return done.returncode, done.stdout + done.stderr


def test_the_docs_show_the_main_commands():
    assert ("script", "scripts/demo.sh") in COMMANDS
    for module in (
        "moonvit",
        "moonvit_projector.export",
        "moonvit_eval.linear_probe",
        "moonvit_train",
        "moonvit.onnx",
        "moonvit.gguf",
    ):
        assert ("module", module) in COMMANDS, module


@pytest.mark.parametrize("kind,target", sorted(k for k in COMMANDS if k not in NOT_RUN), ids="-".join)
def test_every_documented_entry_point_answers_help_and_knows_its_flags(kind, target):
    code, text = help_text(kind, target)
    assert code == 0, f"{target} --help exited {code}:\n{text[-2000:]}"
    assert "usage" in text.lower()
    if kind == "script":
        # demo.sh --help prints the help and runs nothing: no step's output
        assert "linear probes of the shipped checkpoints" not in text
    known = set(_FLAG.findall(text))
    missing = {flag: sorted(where) for flag, where in COMMANDS[(kind, target)].items() if flag not in known}
    assert not missing, f"{target}: flags in the docs that --help does not list: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, re.M):
        base = _anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_relative_link_points_to_a_file_and_heading():
    broken = []
    for path, text in _doc_texts():
        prose = _FENCE.sub("", text)
        targets = re.findall(r"\]\(([^)\s]+)\)", prose) + re.findall(r'src="([^"]+)"', prose)
        for target in targets:
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400
