"""The tree's own rules (DESIGN.md, house style), read from the source with `ast`:
no import cycle, no private name taken from another module, no function-local import of
our own modules without a reason beside it, and modules and classes of a readable size."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "runtime", "parsers", "templates")
MODULE_LINES = 500  # runtime/models (one file per architecture) is exempt
CLASS_LINES = 300


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: list[str]
    is_package: bool
    imports: set[str] = field(default_factory=set)  # modules imported when this one runs


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            text = path.read_text(encoding="utf-8")
            found[name] = Module(name, path, ast.parse(text), text.splitlines(), is_package)
    return found


def _base(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _targets(
    module: Module, node: ast.Import | ast.ImportFrom, known: dict[str, Module]
) -> list[str]:
    """Our modules an import statement loads (a `from pkg import sub` loads pkg.sub)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    base = _base(module, node)
    out = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    if base in known and len(out) < len(node.names):
        out.append(base)
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(
    body: list[ast.stmt], *, local: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import with whether it runs inside a function; `if TYPE_CHECKING:` is skipped."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, local
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from _walk_imports(node.orelse, local=local)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk_imports(node.body, local=True)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _walk_imports([child], local=local)


def _graph(known: dict[str, Module]) -> None:
    for module in known.values():
        for node, local in _walk_imports(module.tree.body):
            if not local:
                module.imports.update(_targets(module, node, known))
        module.imports.discard(module.name)


def _cycles(known: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(known):
        if start in index:
            continue
        work = [(start, iter(sorted(known[start].imports)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(known[child].imports))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_of(module: Module) -> str:
    return module.name if module.is_package else module.name.rpartition(".")[0]


def _private_crossings(module: Module, known: dict[str, Module]) -> Iterator[str]:
    """Underscore names taken from another module, and underscore modules used outside
    their own package (siblings may use them; a subpackage is outside)."""
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _base(module, node)
        if base.split(".")[0] not in PACKAGES:
            continue
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if _private(alias.name) and target not in known:
                yield f"{module.name}:{node.lineno} imports {alias.name} from {base}"
            for path in (base, target) if target in known else (base,):
                parts = path.split(".")
                for depth, part in enumerate(parts):
                    owner = ".".join(parts[:depth])
                    if _private(part) and owner != _package_of(module):
                        yield f"{module.name}:{node.lineno} reaches into {path}"
                        break


def _module_names(module: Module, known: dict[str, Module]) -> dict[str, str]:
    """Local names bound to our modules (`from pkg import mod as m`, `import pkg.mod as m`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    bound[alias.asname] = alias.name
    return bound


def _private_attributes(module: Module, known: dict[str, Module]) -> Iterator[str]:
    """`mod._name` on one of our modules imported under a local name."""
    bound = _module_names(module, known)
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            yield f"{module.name}:{node.lineno} uses {bound[node.value.id]}.{node.attr}"


def _known() -> dict[str, Module]:
    known = _modules()
    _graph(known)
    return known


def test_no_import_cycle() -> None:
    cycles = _cycles(_known())
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_name_crosses_a_module() -> None:
    known = _known()
    found = sorted(
        {hit for m in known.values() for hit in _private_crossings(m, known)}
        | {hit for m in known.values() for hit in _private_attributes(m, known)}
    )
    assert not found, "\n".join(found)


def test_function_local_imports_of_our_modules_say_why() -> None:
    """A lazy import of our own code is for start-up time or a heavy optional dependency,
    never to hide a cycle, and a comment on the line or the one above says which."""
    known = _known()
    bare = []
    for module in known.values():
        for node, local in _walk_imports(module.tree.body):
            if not local or not _targets(module, node, known):
                continue
            line = module.lines[node.lineno - 1]
            above = module.lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            if "#" not in line and not above.startswith("#"):
                bare.append(f"{module.name}:{node.lineno}: {line.strip()}")
    assert not bare, "function-local imports without a reason:\n" + "\n".join(bare)


def test_modules_and_classes_stay_readable() -> None:
    too_long = []
    for module in _modules().values():
        exempt = module.name.startswith("runtime.models.")
        if not exempt and len(module.lines) > MODULE_LINES:
            too_long.append(f"{module.name}: {len(module.lines)} lines")
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > CLASS_LINES:
                    too_long.append(f"{module.name}.{node.name}: {size} lines")
    assert not too_long, "\n".join(too_long)


def test_the_cli_starts_without_mlx() -> None:
    """The CPU backend preloads its BLAS before the first `import mlx` (runtime/backend.py),
    so the CLI's entry module and what it imports at start-up must not import mlx."""
    code = "import sys, gateway.cli.main; print('mlx.core' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# Packages whose __init__ is their public surface: the rest of the tree imports from them,
# never from their modules. runtime.vision.spans is the one exception: it imports MLX, and
# the CLI imports runtime.vision's preprocessing before the BLAS preload (see its __init__).
SURFACES = (
    "runtime.engine",
    "runtime.batch",
    "runtime.text",
    "runtime.prefix",
    "runtime.load",
    "runtime.kernels",
    "runtime.vision",
    "runtime.cache",
    "runtime.distributed",
    "gateway.core.models",
    "gateway.server",
    "parsers.grammars",
)
SURFACE_EXCEPTIONS = frozenset({"runtime.vision.spans"})


def test_packages_are_used_through_their_surface() -> None:
    known = _known()
    reaching = []
    for module in known.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ImportFrom) or node.level:
                continue
            base = node.module or ""
            if base in SURFACE_EXCEPTIONS or base in SURFACES:
                continue
            for surface in SURFACES:
                inside = module.name == surface or module.name.startswith(surface + ".")
                if base.startswith(surface + ".") and not inside:
                    names = [a.name for a in node.names if f"{base}.{a.name}" not in known]
                    if names:
                        reaching.append(f"{module.name}:{node.lineno} takes {names} from {base}")
    assert not reaching, "import these from the package instead:\n" + "\n".join(reaching)
