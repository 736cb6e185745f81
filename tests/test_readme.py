"""The README's promises that can be checked without a GPU: its CPU quick start runs as written,
no line is longer than 120 characters, it stays under 150 lines and links only files that exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_cpu_quick_start_runs_as_written(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    exec(compile(code, "README quick start", "exec"), {})
    assert "torch.Size([1, 1024, 8, 64])" in capsys.readouterr().out


def test_shape_of_the_readme():
    lines = README.splitlines()
    assert len(lines) <= 150
    assert all(len(line) <= 120 for line in lines), [n for n, x in enumerate(lines, 1) if len(x) > 120]
    assert "NOTES.md" not in README and "session" not in README.lower()


def test_local_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert os.path.exists(os.path.join(ROOT, target)), target


def _anchors(path: str) -> set:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    text = open(os.path.join(ROOT, path)).read()
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_local_anchors_exist():
    for target, anchor in re.findall(r"\]\(([^)#]+\.md)#([^)]+)\)", README):
        if not target.startswith("http"):
            assert anchor in _anchors(target), f"{target}#{anchor}"
