"""The import direction (DESIGN.md, "Which way the imports run"): the kernel in
``runtime/`` imports nothing from ``trioserve.actors`` or ``trioserve.transport``, except
the assembly modules that wire them together; ``actors/`` use only the kernel's public
names. Checked over the source with ast, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "runtime"
ACTORS = ROOT / "actors"
#: The assembly: these wire the actors (and the CLI a transport) onto the kernel.
ASSEMBLY = {"_runtime.py", "_rollout_start.py", "_thread.py", "_bench.py", "cli.py"}
UPPER_LAYERS = ("trioserve.actors", "trioserve.transport")


def imported_modules(source: str, *, package: str) -> set[str]:
    """Every module a source file imports, absolute, resolving relative imports
    against ``package`` and naming ``from pkg import sub`` as ``pkg.sub``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def upper_layer_imports(source: str, *, package: str = "trioserve") -> set[str]:
    return {
        m
        for m in imported_modules(source, package=package)
        if any(m == layer or m.startswith(layer + ".") for layer in UPPER_LAYERS)
    }


KERNEL_MODULES = sorted(p.name for p in KERNEL.glob("*.py") if p.name not in ASSEMBLY)


def test_the_kernel_and_assembly_modules_exist():
    # Guards the parametrization below from silently checking nothing.
    assert {"_actor.py", "_config.py", "_messages.py", "_model.py"} <= set(KERNEL_MODULES)
    assert ASSEMBLY <= {p.name for p in KERNEL.glob("*.py")}


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_module_does_not_import_actors_or_transport(name):
    source = (KERNEL / name).read_text()
    assert upper_layer_imports(source) == set(), (
        f"runtime/{name} imports an upper layer; only {sorted(ASSEMBLY)} may"
    )


@pytest.mark.parametrize("name", sorted(p.name for p in ACTORS.glob("*.py")))
def test_actors_use_only_the_kernels_public_names(name):
    source = (ACTORS / name).read_text()
    private = {
        m
        for m in imported_modules(source, package="trioserve.actors")
        if m.startswith("trioserve._")
    }
    assert private == set(), f"actors/{name} imports kernel internals: {sorted(private)}"
    assert not any(
        m.startswith("trioserve.transport") for m in imported_modules(source, package="x")
    )


@pytest.mark.parametrize(
    "source",
    [
        "import trioserve.actors",
        "from trioserve.actors import BatcherActor",
        "from trioserve import actors",
        "from trioserve.transport._v2 import parse",
        "from .actors import FifoQueue",
        "from . import transport",
        "def f():\n    from trioserve.actors import SchedulerActor\n",
    ],
)
def test_the_checker_sees_every_form_of_import(source):
    assert upper_layer_imports(source) != set()


@pytest.mark.parametrize(
    "source",
    [
        "from ._errors import ActorBroken",
        "import trio",
        "from trioserve import Request",
        "import trioserve_actors",
    ],
)
def test_the_checker_allows_kernel_imports(source):
    assert upper_layer_imports(source) == set()


@pytest.mark.parametrize("name", ["without_model"])
def test_helpers_of_the_kernel_for_its_own_layers_are_not_public(name):
    """A helper the transport takes from the kernel's modules (``trioserve._errors``)
    is not one of the package's names: its users would depend on it."""
    import trioserve

    assert not hasattr(trioserve, name)
