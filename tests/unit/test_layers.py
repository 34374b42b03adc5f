"""``pdserve/`` is built in layers, and every import points down: no upward import, no cycle.

Why: each layer must be understandable, testable and replaceable without the ones above it. The wire
types (``protocol``) are what every layer shares; ``checkpoints`` locates model files; text handling
(``text``) and output parsing
(``parsers``) build on them; the engine produces token ids and knows nothing of text, so a different
engine backend can drop in; ``output`` turns engine output into responses; ``serve`` wires it all into
HTTP; ``bench`` drives the whole stack from outside. An upward import (the engine loading a tokenizer,
a route reaching back into the app that mounts it) ties a low layer to a policy above it and sooner or
later closes an import cycle, whose import order then decides what works.

The rules are this file's data, so adding a package means placing it here on purpose:

* ``LAYERS``: for each package directly under ``pdserve/``, the other packages its modules may import.
  A module under a package missing from the table fails the test.
* Inside ``serve/``, routes sit directly under the app that mounts them: only ``SERVE_APP_IMPORTERS``
  (the process entry points) import ``serve/app.py``, only the app imports a route, and no route
  imports another route (shared request handling belongs in a module below the routes).
* No import cycle between any two modules of ``pdserve/``.

Imports are read with ``ast`` from the source, wherever the statement sits (module level, inside a
function, under ``if TYPE_CHECKING``): a deferred import is still a dependency, only a later one. The
rules are on direct imports; relative imports are resolved against the importing module's package.
Importing a package's submodule also runs the package's ``__init__``; that implicit edge is not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pdserve"

_BELOW_SERVE = frozenset({"protocol", "text", "parsers", "engine", "checkpoints", "output", "web"})
LAYERS: dict[str, frozenset[str]] = {
    "protocol": frozenset(),  # wire types only
    # Where model files come from (weights, GGUF conversion, tokenizer files, model-dir facts such as
    # EOS ids): below text and engine, which both read the files it locates.
    "checkpoints": frozenset({"protocol"}),
    "text": frozenset({"protocol", "checkpoints"}),
    "parsers": frozenset({"protocol", "text"}),
    "engine": frozenset({"protocol", "checkpoints"}),  # token ids in, token ids out: never text
    "output": frozenset({"protocol", "text", "parsers"}),
    # HTTP pieces the server and the proxy share (the client-disconnect race): below both, above nothing.
    "web": frozenset(),
    "serve": _BELOW_SERVE,
    "proxy": _BELOW_SERVE,
    # ``pdserve up``: plans and supervises server processes (the proxy's mode names); its process launcher
    # (topology/process.py) is the one the benchmarks and the tests start servers with.
    "topology": _BELOW_SERVE | {"proxy"},
    "bench": _BELOW_SERVE | {"serve", "proxy", "topology"},
    # Wire rules checked from outside: imports no other pdserve package, so it cannot share a server's bug.
    "conformance": frozenset(),
    "schema": frozenset({"protocol"}),  # JSON Schema export of the wire types
    # ``pdserve top``: reads a fleet's /metrics by name over HTTP, imports no other pdserve package.
    "top": frozenset(),
    "cli": _BELOW_SERVE | {"serve", "proxy", "bench", "conformance", "schema", "topology", "top"},  # the ``pdserve`` entry point
    "data": frozenset(),  # package data only, read through importlib.resources
}
SERVE_APP = f"{PACKAGE}.serve.app"
SERVE_APP_IMPORTERS = frozenset({f"{PACKAGE}.serve.runner"})
SERVE_ROUTES = f"{PACKAGE}.serve.routes"


@dataclass(frozen=True)
class Import:
    """One import statement of ``source``, resolved to the ``target`` module it loads."""

    source: str
    target: str
    file: str  # relative to the root the package sits in
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def modules_under(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (under ``root``) by dotted name; a package is its ``__init__``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module ``name`` loads: itself, or its longest prefix that is a module (``a.b.attr`` → ``a.b``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _base(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module an ``from X import ...`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imports_of(module: str, path: Path, modules: Mapping[str, Path], root: Path) -> Iterator[Import]:
    """The imports of one module that load a module of the package, wherever they sit in the file."""
    file = path.relative_to(root).as_posix()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, module, path)
            # ``from a import b`` loads module a.b when there is one, else takes the name b from a.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                yield Import(module, target, file, node.lineno)


def import_graph(root: Path, package: str) -> list[Import]:
    modules = modules_under(root, package)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules, root)]


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted, the list sorted."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(groups)


def _in_file_order(imports: list[Import]) -> list[Import]:
    """Each import once (``from a import b, c`` is one statement), by file and line, for a readable report."""
    return sorted(set(imports), key=lambda imp: (imp.file, imp.line, imp.target))


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(imports: list[Import], layers: Mapping[str, frozenset[str]]) -> list[str]:
    """Imports from one top-level package into another that its row of ``layers`` does not allow."""
    found = []
    for imp in _in_file_order(imports):
        source, target = _layer(imp.source), _layer(imp.target)
        if source is None or target is None or source == target:
            continue
        if source not in layers:
            found.append(f"{imp}: package {source!r} is not in LAYERS")
        elif target not in layers[source]:
            allowed = f"only {', '.join(sorted(layers[source]))}" if layers[source] else "no other package"
            found.append(f"{imp}: {source} may import {allowed}")
    return found


def _is_route(module: str) -> bool:
    return module.startswith(SERVE_ROUTES + ".")


def serve_violations(imports: list[Import]) -> list[str]:
    """Imports inside ``serve/`` that point up: into the app, into a route from outside the app."""
    found = []
    for imp in _in_file_order(imports):
        if imp.target == SERVE_APP and imp.source not in SERVE_APP_IMPORTERS:
            found.append(f"{imp}: only {', '.join(sorted(SERVE_APP_IMPORTERS))} may import the app")
        elif _is_route(imp.target) and _is_route(imp.source):
            found.append(f"{imp}: a route imports another route")
        elif _is_route(imp.target) and imp.source != SERVE_APP:
            found.append(f"{imp}: only {SERVE_APP} may import a route")
    return found


def _report(what: str, problems: list[str]) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(problems)


# ---------------------------------------------------------------- the tree


def test_every_package_is_placed_in_the_layers() -> None:
    packages = {_layer(m) for m in modules_under(ROOT, PACKAGE)} - {None}
    assert packages - set(LAYERS) == set(), "place each new package in LAYERS"


def test_no_import_cycles() -> None:
    found = [" → ".join(group) for group in cycles(import_graph(ROOT, PACKAGE))]
    assert not found, _report("groups of modules importing each other", found)


def test_packages_import_only_downwards() -> None:
    found = layer_violations(import_graph(ROOT, PACKAGE), LAYERS)
    assert not found, _report("upward imports between packages", found)


def test_serve_routes_sit_directly_under_the_app() -> None:
    found = serve_violations(import_graph(ROOT, PACKAGE))
    assert not found, _report("upward imports inside serve/", found)


# ---------------------------------------------------------------- the checker, on a hand-made tree


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def later():\n    from pkg.high import b\n",  # deferred, upward, closes a cycle
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from ..low import a\nfrom .c import name\n",
        "pkg/high/c.py": "import pkg.low.a as alias\nname = 1\n",
    })
    imports = import_graph(tmp_path, "pkg")
    assert sorted((i.source, i.target, i.line) for i in imports) == [
        ("pkg.high.b", "pkg.high.c", 2), ("pkg.high.b", "pkg.low.a", 1), ("pkg.high.c", "pkg.low.a", 1),
        ("pkg.low.a", "pkg.high.b", 2),
    ]
    assert cycles(imports) == [["pkg.high.b", "pkg.high.c", "pkg.low.a"]]  # b → c → a → b
    layers = {"low": frozenset(), "high": frozenset({"low"})}
    assert layer_violations(imports, layers) == ["pkg/low/a.py:2 imports pkg.high.b: low may import no other package"]
    assert layer_violations(imports, {"low": frozenset()}) == [
        "pkg/high/b.py:1 imports pkg.low.a: package 'high' is not in LAYERS",
        "pkg/high/c.py:1 imports pkg.low.a: package 'high' is not in LAYERS",
        "pkg/low/a.py:2 imports pkg.high.b: low may import no other package",
    ]


def test_checker_applies_the_serve_rules(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pdserve/__init__.py": "",
        "pdserve/serve/__init__.py": "",
        "pdserve/serve/app.py": "from pdserve.serve.routes import generate\n",
        "pdserve/serve/runner.py": "from pdserve.serve import app\n",
        "pdserve/serve/state.py": "from pdserve.serve.routes.generate import handler\n",
        "pdserve/serve/routes/__init__.py": "",
        "pdserve/serve/routes/generate.py": "from pdserve.serve.app import build\n",
        "pdserve/serve/routes/openai.py": "from pdserve.serve.routes.generate import prepare\n",
    })
    assert serve_violations(import_graph(tmp_path, "pdserve")) == [
        ("pdserve/serve/routes/generate.py:1 imports pdserve.serve.app: only pdserve.serve.runner may import "
         "the app"),
        "pdserve/serve/routes/openai.py:1 imports pdserve.serve.routes.generate: a route imports another route",
        "pdserve/serve/state.py:1 imports pdserve.serve.routes.generate: only pdserve.serve.app may import a route",
    ]
