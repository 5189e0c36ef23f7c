"""The package's floors hold: a folder says which process runs its code, and imports only go down
(DESIGN.md, "Layout"). Walked over every module's imports, also those inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "braid"

# What each part of braid must not import (by module prefix).
FORBIDDEN = {
    # the floor: wire types, errors, host facts, named entry points
    "braid.step": ["braid."],
    "braid.errors": ["braid."],
    "braid.platform": ["braid."],
    "braid.spawn": ["braid."],
    "braid.settings": ["braid.", "!braid.errors"],
    "braid.config": ["braid.", "!braid.errors", "!braid.platform", "!braid.settings"],
    # below the worker
    "braid.layers": ["braid.engine", "braid.worker", "braid.server", "braid.frontend",
                     "braid.bench", "braid.eval", "braid.cli", "braid.models"],
    "braid.models": ["braid.engine", "braid.worker", "braid.server", "braid.frontend",
                     "braid.bench", "braid.eval", "braid.cli"],
    "braid.overlap": ["braid.engine", "braid.worker", "braid.server", "braid.frontend",
                      "braid.models"],
    "braid.distributed": ["braid.engine", "braid.worker", "braid.server", "braid.frontend",
                          "braid.models", "braid.layers"],
    # the driver launches ranks by name; the ranks know nothing of the driver
    "braid.engine": ["braid.worker", "braid.server", "braid.frontend", "braid.bench",
                     "braid.eval", "braid.cli"],
    "braid.worker": ["braid.engine", "braid.server", "braid.frontend", "braid.bench",
                     "braid.eval", "braid.cli"],
    "braid.frontend": ["braid.worker", "braid.server", "braid.bench", "braid.eval", "braid.cli"],
    # the API process starts the engine process by name and holds no model code
    "braid.server": ["braid.worker", "braid.models", "braid.layers", "braid.engine.core",
                     "braid.engine.executor", "braid.engine.process", "braid.cli"],
    "braid.eval": ["braid.bench", "!braid.bench.client", "braid.cli"],
    "braid.bench": ["braid.eval", "braid.cli"],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> dict[str, int]:
    """braid modules a file imports (anywhere in it) -> the line of the first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("braid."):  # (`from braid import x` is also braid.x)
                found.setdefault(name, node.lineno)
    return found


def violates(importer: str, imported: str, rules: list[str]) -> bool:
    """Whether `imported` is forbidden by `rules`: prefixes, `!prefix` exceptions, and
    `name!` for one module only (its own file may be imported by the owner of the rule)."""
    def under(name: str, prefix: str) -> bool:
        return name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".")
                                                               else prefix + ".")

    allowed = [r[1:] for r in rules if r.startswith("!")]
    if any(under(imported, prefix) for prefix in allowed):
        return False
    for rule in rules:
        if rule.startswith("!"):
            continue
        if rule.endswith("!"):  # that module only, not from its own package's other files
            if imported == rule[:-1] and importer != rule[:-1]:
                return True
        elif under(imported, rule):
            return True
    return False


def test_imports_only_go_down():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for owner, rules in FORBIDDEN.items():
            if importer != owner and not importer.startswith(owner + "."):
                continue
            for imported, line in imports_of(path).items():
                if imported != importer and violates(importer, imported, rules):
                    problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {importer} "
                                    f"imports {imported}")
    assert not problems, "\n".join(problems)


def test_module_level_imports_have_no_cycle():
    """No two modules import each other at load time (a function-level import may break a
    cycle only where it says why)."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            edges |= {c for c in candidates if c in modules and c != name}
        graph[name] = edges

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = {tuple(c) for m in graph if (c := cycle_from(m)) is not None}
    assert not cycles, "\n".join(" -> ".join(c) for c in sorted(cycles))


@pytest.mark.timeout(120)
def test_the_api_process_loads_no_model_code(model_path):
    """The server's API process (`braid serve`'s flags parsed, the server's modules and the
    tokenizer loaded from the GGUF file) holds no module of the model, its layers or the ranks
    (it gets the model's config from the engine)."""
    script = (
        "import sys\n"
        "from braid.cli import build_parser\n"
        "build_parser('serve').parse_args(['serve', '--tp', '2'])\n"
        "import braid.server.serve, braid.server.api\n"
        "from braid.loader.tokenizer import load_tokenizer\n"
        f"load_tokenizer({model_path!r})\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('braid'))))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.split()
    assert "braid.server.api" in loaded
    heavy = [m for m in loaded
             if m.startswith(("braid.models", "braid.layers", "braid.worker", "braid.engine.core",
                              "braid.engine.executor"))]
    assert not heavy, heavy
