"""The packages of grpo/ import downward only (docs/architecture.md): process at the bottom, the scripts on top.

Every module is parsed, not imported: an import inside a function counts as much as one at the top of the file."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "grpo"
# bottom to top; a package may import those below it, never one above. grpo/__init__.py runs first in every
# process whatever is imported, and sits on top with the scripts: it imports nothing of grpo.
LAYERS = ("process", "tasks", "training", "inference", "rollout", "export", "loop", "scripts")
SCRIPTS = ("__init__", "grpo", "grpo-async")


def layer_of(parts: tuple[str, ...]) -> str:
    """The layer of module ``grpo.<parts>``: its package, ``export`` for grpo/export.py, ``scripts`` for the rest."""
    if len(parts) > 1:
        return parts[0]
    return "scripts" if parts[0] in SCRIPTS else parts[0]


def imported(parts: tuple[str, ...], source: str) -> list[tuple[int, str]]:
    """Each grpo module that module ``grpo.<parts>`` (its ``source``) imports, with its line: module-level, in
    functions, relative ones resolved."""
    package = ("grpo", *parts[:-1])  # a relative import's level 1, for a module and a package's __init__ alike
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *([node.module] if node.module else [])))
            if module == "grpo":  # from grpo import export: the module named
                found += [(node.lineno, f"grpo.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, name) for line, name in found if name.startswith("grpo.")]


def upward_imports() -> list[str]:
    found = []
    for path in sorted(GRPO.rglob("*.py")):
        parts = path.relative_to(GRPO).with_suffix("").parts
        mine = layer_of(parts)
        for line, name in imported(parts, path.read_text()):
            theirs = layer_of(tuple(name.split(".")[1:]))
            for layer in (mine, theirs):
                assert layer in LAYERS, f"{path.relative_to(REPO)}:{line}: package {layer!r} has no place in LAYERS"
            if LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{path.relative_to(REPO)}:{line}: {mine} imports {theirs} ({name}), a package above it")
    return found


def test_packages_import_downward_only():
    upward = upward_imports()
    assert not upward, f"{len(upward)} upward import(s):\n" + "\n".join(upward)


def test_imports_in_functions_and_relative_ones_count():
    source = ("import os\nfrom . import sampling\nfrom ..loop.run import follow_run\nfrom grpo import export\n\n\n"
              "def f():\n    import grpo.rollout.replies\n")
    assert imported(("inference", "engine"), source) == [
        (2, "grpo.inference"), (3, "grpo.loop.run"), (4, "grpo.export"), (8, "grpo.rollout.replies")]
