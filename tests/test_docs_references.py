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
    """The inline code spans of a page (a span that wraps a line joined up)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]


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
            span = re.sub(r"<\w+>", "*", span)  # a placeholder: fuzz/_<name>.py
            for m in re.finditer(
                r"\b((?:runtime|actors|transport|tests|fuzz)/[\w/.*-]*\w)(?:::(\w+))?", span
            ):
                path, test = m[1], m[2]
                paths += 1
                assert any(ROOT.glob(path)), (page.name, path)
                if test:
                    assert f"def {test}(" in (ROOT / path).read_text(), (page.name, span)
        for test in set(re.findall(r"\b(test_\w+)\b", text)) - EXAMPLES:
            defined = f"def {test}(" in tests or (ROOT / "tests" / f"{test}.py").exists()
            assert defined, (page.name, test)
    assert paths > 20


def test_every_config_key_named_is_one():
    """A ``key = value`` span names a key of some table, and a ``server.key``,
    ``runtime.key`` or ``cache.key`` span a key of that table (configuration.md's
    example is checked whole in tests/test_config.py)."""
    import attrs
    import trioserve

    tables = {
        "runtime": trioserve.RuntimeLimits, "server": trioserve.ServerConfig,
        "cache": trioserve.CacheConfig, "models": trioserve.ModelConfig,
        "tenants": trioserve.TenantConfig, "classes": trioserve.ClassConfig,
    }
    keys = {f.name for cls in tables.values() for f in attrs.fields(cls)}
    named = 0
    for page in PAGES:
        for span in _spans(page.read_text()):
            if m := re.fullmatch(r"(\w+) = .+", span):
                named += 1
                assert m[1] in keys, (page.name, span)
            dotted = r"(?<![\w/.])(runtime|server|cache)\.(\w+)\b(?![.(])"
            for table, key in re.findall(dotted, span):
                named += 1
                assert key in attrs.fields_dict(tables[table]), (page.name, span)
    assert named > 20


def _free_names(source: str) -> set[str]:
    """The global names a Python example reads and never binds (nor are builtins)."""
    import builtins
    import symtable

    top = symtable.symtable(source, "<example>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for s in table.get_symbols():
            top_level_read = table is top and s.is_referenced()
            if top_level_read or (table is not top and s.is_global()):
                used.add(s.get_name())
    return used - bound - set(dir(builtins))


def test_every_python_example_binds_every_name_it_uses():
    """Each ```python block of the usage pages runs as written when pasted into a
    file: it imports and defines what it uses (the blocking example of embedding.md
    used ``config`` and ``x`` from nowhere). cache.md and fuzzing.md show sketches
    (an actor's logic, a printed reproduction), not programs."""
    examples = 0
    for page in (ROOT / "README.md", ROOT / "docs" / "embedding.md"):
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            examples += 1
            assert _free_names(block) == set(), (page.name, block.splitlines()[0])
    assert examples >= 4


def test_configuration_md_names_every_config_class():
    """configuration.md's list of the Python objects the TOML tables are holds every
    public ``*Config`` class (AutoscalingConfig, VersionConfig and RolloutConfig were
    missing from it)."""
    import trioserve

    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    listed = re.search(r"the same values exist as Python objects \(([^)]*)\)", text)
    assert listed is not None
    named = set(re.findall(r"`(?:trioserve\.)?(\w+)`", listed[1]))
    public = {
        n for n in dir(trioserve)
        if (n.endswith("Config") or n == "RuntimeLimits")
        and isinstance(getattr(trioserve, n), type)
    }
    assert public <= named, sorted(public - named)


def test_architecture_md_names_every_module_of_the_front_door():
    """The front door's mixins, "a module each": architecture.md names the module of
    every base class of ``Runtime`` (the rollout's operator actions were missing)."""
    from trioserve._front import Runtime

    text = (ROOT / "docs" / "architecture.md").read_text()
    for base in Runtime.__mro__[1:-1]:  # not object
        package, _, module = base.__module__.partition(".")
        assert package == "trioserve", base
        assert f"`runtime/{module}.py`" in text, (base.__name__, module)


def test_the_readme_points_at_every_page_of_docs():
    """The README's guide to docs/ ("See `docs/embedding.md` for the API, ...") names
    each page (model-control.md was missing from it)."""
    guide = re.search(r"^See `docs/.*?(?=\n\n)", (ROOT / "README.md").read_text(), re.S | re.M)
    assert guide is not None
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"`docs/{page.name}`" in guide[0], page.name
