"""What README.md, docs/*.md and fuzz/README.md point at exists: each relative link
resolves, each repository path a code span names is a file, and each test a page
names (``tests/test_x.py::test_y`` or a bare ``test_y``) is defined."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "fuzz" / "README.md"]
#: A test a page shows as an example of a printed reproduction, not one of the suite's.
EXAMPLES = {"test_fuzz_runtime_seed_127135284463573"}


def _spans(text: str) -> list[str]:
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]


def test_every_relative_link_resolves():
    links = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            links += 1
            assert (page.parent / target).exists(), (page.name, target)
    assert links > 10


def test_every_path_and_test_named_exists():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    paths = 0
    for page in PAGES:
        text = page.read_text()
        for span in _spans(text):
            for m in re.finditer(
                r"\b((?:runtime|actors|transport|tests|fuzz)/[\w/.-]*\w)(?:::(\w+))?", span
            ):
                path, test = m[1], m[2]
                paths += 1
                assert (ROOT / path).exists(), (page.name, path)
                if test:
                    assert f"def {test}(" in (ROOT / path).read_text(), (page.name, span)
        for test in set(re.findall(r"\b(test_\w+)\b", text)) - EXAMPLES:
            defined = f"def {test}(" in tests or (ROOT / "tests" / f"{test}.py").exists()
            assert defined, (page.name, test)
    assert paths > 20
