"""Check the patch ledger's vLLM symbols against a vLLM *source tree*, without importing it.

    python3 -m scripts.vllm_surface SRC [--against SRC2]

SRC is a directory holding the ``vllm`` package, e.g. a wheel unpacked with ``unzip``
(GPU wheels cannot be imported on a CPU machine, but their Python source can be read).
For every symbol in ``vllm_ddtree._patch.LEDGER`` (``replaces``, ``reads`` and
``reads_cuda_only``) it finds the module file, then walks the qualified name through
module-level definitions, re-exports (``from x import y``, ``import *``), class bodies,
``self.name = ...`` assignments in methods and base classes.  Functions get their
parameter list.  ``--against`` prints the symbols whose status or parameters differ
between the two trees.  Exit status 1 when a symbol is missing in SRC.

Attributes that a class decorator generates (``__dataclass_fields__``,
``__pydantic_validator__``, ...) cannot be seen in source: they are reported as
``generated`` when the class has a decorator, and as missing when it has none.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

GENERATED = {"__dataclass_fields__", "__annotations__", "__init__", "__post_init__",
             "__pydantic_fields__", "__pydantic_validator__"}


@dataclass
class Found:
    status: str  # "found", "generated" or "missing"
    where: str = ""
    params: tuple[str, ...] | None = None


class Tree:
    def __init__(self, root: Path):
        self.root = root
        self._mods: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._mods:
            base = self.root / name.replace(".", "/")
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                         if p.is_file()), None)
            self._mods[name] = ast.parse(path.read_text()) if path else None
        return self._mods[name]

    # -- module level -------------------------------------------------------------
    def lookup(self, mod: str, name: str, seen=None) -> tuple[str, ast.AST] | None:
        """(module, node) that defines ``name`` in module ``mod``."""
        seen = seen or set()
        if (mod, name) in seen:
            return None
        seen.add((mod, name))
        tree = self.module(mod)
        if tree is None:
            return None
        stars = []
        for node in _flat(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name == name:
                return mod, node
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return mod, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name:
                return mod, node
            if isinstance(node, ast.ImportFrom):
                src = self._absolute(mod, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(src)
                    elif (alias.asname or alias.name) == name:
                        sub = f"{src}.{alias.name}"
                        if self.module(sub) is not None:
                            return sub, self.module(sub)
                        hit = self.lookup(src, alias.name, seen)
                        if hit:  # else: a guarded import; a fallback may follow
                            return hit
        for src in stars:
            hit = self.lookup(src, name, seen)
            if hit:
                return hit
        return None

    def _absolute(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        is_pkg = (self.root / mod.replace(".", "/") / "__init__.py").is_file()
        parts = mod.split(".")
        keep = len(parts) - node.level + (1 if is_pkg else 0)
        base = ".".join(parts[:keep])
        return f"{base}.{node.module}" if node.module else base

    # -- class level --------------------------------------------------------------
    def member(self, mod: str, cls: ast.ClassDef, name: str, depth: int = 0):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == name:
                return mod, node
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return mod, node
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and node.attr == name \
                    and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                return mod, node
        if depth < 8:
            for base in cls.bases:
                hit = self._base(mod, base)
                if hit:
                    found = self.member(hit[0], hit[1], name, depth + 1)
                    if found:
                        return found
        return None

    def _base(self, mod: str, expr: ast.expr):
        if isinstance(expr, ast.Subscript):  # Generic[T], Base[...]
            expr = expr.value
        if isinstance(expr, ast.Name):
            hit = self.lookup(mod, expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            owner = self.lookup(mod, expr.value.id)
            hit = self.lookup(owner[0], expr.attr) if owner else None
        else:
            hit = None
        return hit if hit and isinstance(hit[1], ast.ClassDef) else None

    # -- symbols ------------------------------------------------------------------
    def find(self, symbol: str) -> Found:
        mod, _, qual = symbol.partition(":")
        if self.module(mod) is None:
            return Found("missing", f"no module {mod}")
        hit: tuple[str, ast.AST] | None = (mod, self.module(mod))
        parts = qual.split(".")
        for i, part in enumerate(parts):
            owner_mod, node = hit
            if isinstance(node, ast.Module):
                hit = self.lookup(owner_mod, part)
            elif isinstance(node, ast.ClassDef):
                hit = self.member(owner_mod, node, part)
                if hit is None and part in GENERATED and node.decorator_list:
                    return Found("generated", f"{owner_mod}:{node.name} (decorated)")
            else:
                hit = None
            if hit is None:
                return Found("missing", f"{'.'.join(parts[: i + 1])} not found")
        owner_mod, node = hit
        params = _params(node) if isinstance(node, (ast.FunctionDef,
                                                     ast.AsyncFunctionDef)) else None
        return Found("found", owner_mod, params)


def _flat(body):
    """Module-level statements, including those under ``if``/``try``/``with`` (guarded
    imports such as ``if is_flash_attn_varlen_func_available(): from ... import ...``)."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            yield from _flat(node.body)
            yield from _flat(getattr(node, "orelse", []))
            for h in getattr(node, "handlers", []):
                yield from _flat(h.body)
            yield from _flat(getattr(node, "finalbody", []))
        else:
            yield node


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    out = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return tuple(out)


def ledger_symbols() -> list[tuple[str, str]]:
    from vllm_ddtree._patch import LEDGER

    out = []
    for entry in LEDGER:
        for sym in (*entry.replaces, *entry.reads, *entry.reads_cuda_only):
            if sym.startswith("vllm") and (entry.name, sym) not in out:
                out.append((entry.name, sym))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="directory that holds the vllm package")
    ap.add_argument("--against", type=Path, help="a second source tree to compare with")
    args = ap.parse_args(argv)
    a, b = Tree(args.src), Tree(args.against) if args.against else None
    missing = 0
    rows = []
    symbols = ledger_symbols()
    for entry, sym in symbols:
        fa = a.find(sym)
        missing += fa.status == "missing"
        if b is None:
            rows.append(f"{fa.status:<9} {entry:<18} {sym}"
                        + (f"  {fa.where}" if fa.status == "missing" else ""))
            continue
        fb = b.find(sym)
        if (fa.status, fa.params) != (fb.status, fb.params):
            rows.append(f"{entry:<18} {sym}\n    {args.src}: {fa.status} {fa.params}\n"
                        f"    {args.against}: {fb.status} {fb.params}")
    print("\n".join(rows) if rows else "no differences")
    print(f"\n{len(symbols)} ledger symbols; missing in {args.src}: {missing}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
