"""Offline text for the SmolLM2 drafter: documents, the held-out split, prompts.

Every machine has the Python standard library's sources and usually ``/usr/share/doc``;
nothing is downloaded.  The same functions serve the drafter trainer
(``scripts/train_drafter.py``) and the acceptance benchmark, so both agree on what is
held out.

* :func:`iter_documents` yields :class:`Doc` (``source`` ``"stdlib"`` or ``"doc"``, a
  stable relative ``name``, the text) in a fixed order.
* :func:`is_heldout` is the split: a document is held out when
  ``crc32(source + ":" + name) % 10 == 0`` (about 10 %).  It depends on the name only,
  so it is stable across machines; which documents exist depends on the Python version
  and the installed OS packages (recorded in the drafter's card).
* :func:`code_prompt`, :func:`chat_prompts` build prompts from a document: a code prefix
  to continue, and ChatML instructions (write a function from its docstring, explain a
  function, summarize a paragraph); :func:`build_prompts` draws tokenized prompts of
  both kinds from a list of documents.

Only the standard library is imported.
"""

from __future__ import annotations

import ast
import functools
import gzip
import os
import random
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HELDOUT_MOD = 10
DOC_ROOT = Path("/usr/share/doc")
DOC_SUFFIXES = {"", ".txt", ".md", ".rst", ".gz"}
MAX_DOC_BYTES = 200_000
MIN_DOC_CHARS = 200


@dataclass(frozen=True)
class Doc:
    source: str  # "stdlib" or "doc"
    name: str  # path relative to the source root
    text: str

    @property
    def key(self) -> str:
        return f"{self.source}:{self.name}"


def is_heldout(doc_or_key) -> bool:
    key = doc_or_key.key if isinstance(doc_or_key, Doc) else str(doc_or_key)
    return zlib.crc32(key.encode()) % HELDOUT_MOD == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_text(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_DOC_BYTES:
            return None
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
            if len(raw) > MAX_DOC_BYTES:
                return None
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    if "\x00" in text or len(text) < MIN_DOC_CHARS:
        return None
    return text


def iter_stdlib(root: Path | None = None) -> Iterator[Doc]:
    root = root or stdlib_root()
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or "__pycache__" in rel.parts:
            continue
        text = _read_text(p)
        if text is not None:
            yield Doc("stdlib", rel.as_posix(), text)


def iter_usr_share_doc(root: Path = DOC_ROOT) -> Iterator[Doc]:
    """Plain-text files of ``/usr/share/doc`` (``.gz`` decompressed), each distinct text
    once (copyright files repeat across packages)."""
    if not root.is_dir():
        return
    seen: set[int] = set()
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.is_symlink() or p.suffix not in DOC_SUFFIXES:
            continue
        text = _read_text(p)
        if text is None:
            continue
        h = zlib.crc32(text.encode())
        if h in seen:
            continue
        seen.add(h)
        yield Doc("doc", p.relative_to(root).as_posix(), text)


def iter_documents(sources: tuple[str, ...] = ("stdlib", "doc")) -> Iterator[Doc]:
    if "stdlib" in sources:
        yield from iter_stdlib()
    if "doc" in sources:
        yield from iter_usr_share_doc()


# ------------------------------------------------------------------ prompts ---------
def code_prompt(doc: Doc, rng: random.Random, min_lines: int = 4, max_lines: int = 40) -> str:
    """A prefix of ``doc`` ending at a line boundary, starting at a top-level line."""
    lines = doc.text.splitlines(keepends=True)
    if len(lines) <= min_lines:
        return doc.text
    starts = [i for i, ln in enumerate(lines[:-min_lines])
              if ln.strip() and not ln[0].isspace()] or [0]
    s = rng.choice(starts)
    n = rng.randint(min_lines, max_lines)
    return "".join(lines[s:s + n])


def _functions(text: str) -> list[tuple[str, str, str]]:
    """(signature, first docstring paragraph, source) of the documented public functions
    and methods at module and class level (no nested functions)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines(keepends=True)
    nodes = list(tree.body)
    nodes += [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    out = []
    for node in nodes:
        if (not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                or node.name.startswith("_")):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno - node.lineno > 80:
            continue
        para = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if len(para) < 20:
            continue
        src = "".join(lines[node.lineno - 1:node.end_lineno])  # whole lines
        indent = len(src) - len(src.lstrip(" "))
        src = "".join(ln[indent:] if ln[:indent].isspace() else ln
                      for ln in src.splitlines(keepends=True)).rstrip()
        out.append((f"{node.name}({ast.unparse(node.args)})", para, src))
    return out


_FUNCTIONS: dict[str, list[tuple[str, str, str]]] = {}


def documented_functions(doc: Doc) -> list[tuple[str, str, str]]:
    """:func:`_functions` of a stdlib document, cached by document."""
    if doc.key not in _FUNCTIONS:
        _FUNCTIONS[doc.key] = _functions(doc.text)
    return _FUNCTIONS[doc.key]


def prefetch_functions(docs: list[Doc], workers: int) -> None:
    """Parse the stdlib documents in ``workers`` processes (``ast.parse`` dominates the
    cost of building thousands of chat prompts)."""
    todo = [d for d in docs if d.source == "stdlib" and d.key not in _FUNCTIONS]
    if workers <= 1 or len(todo) < 64:
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        for d, fns in zip(todo, pool.map(_functions, [d.text for d in todo], chunksize=16)):
            _FUNCTIONS[d.key] = fns


@functools.lru_cache(maxsize=4096)
def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 1500]


def chat_prompts(doc: Doc, rng: random.Random, k: int = 2) -> list[str]:
    """Up to ``k`` user messages (plain strings; apply the chat template yourself)."""
    msgs: list[str] = []
    if doc.source == "stdlib":
        for sig, para, src in (rng.sample(fns, min(k, len(fns)))
                               if (fns := documented_functions(doc)) else []):
            if rng.random() < 0.5:
                msgs.append(f"Write a Python function `{sig}`: {para}")
            else:
                msgs.append(f"Explain what this Python function does:\n\n```python\n{src}\n```")
    else:
        paras = _paragraphs(doc.text)
        for para in rng.sample(paras, min(k, len(paras))):
            msgs.append(rng.choice([
                "Summarize the following text in a few sentences:\n\n",
                "What is the following text about?\n\n",
                "Rewrite the following text in simpler words:\n\n",
            ]) + para)
    return msgs


def build_prompts(tok: Any, docs: list[Doc], n: int, rng: random.Random, chat_frac: float,
                  max_prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """``n`` prompts (token lists, ``tok``: a Hugging Face tokenizer with a chat template)
    from ``docs``: a ``chat_frac`` share of ChatML instructions, the rest code prefixes to
    continue; returns ``(prompts, kinds)``, kinds ``"chat"`` or ``"code"``."""
    code_docs = [d for d in docs if d.source == "stdlib"] or docs
    if n * chat_frac >= 500:
        prefetch_functions(docs, min(16, os.cpu_count() or 1))
    prompts, kinds = [], []
    for _ in range(n):
        kind = "chat" if rng.random() < chat_frac else "code"
        for _try in range(50):  # many documents give no chat prompt: draw another
            if kind == "chat":
                msgs = chat_prompts(rng.choice(docs), rng, k=1)
                if not msgs:
                    continue
                text = tok.apply_chat_template([{"role": "user", "content": msgs[0]}],
                                               tokenize=False, add_generation_prompt=True)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if len(ids) > max_prompt_tokens:
                    continue
            else:
                ids = tok(code_prompt(rng.choice(code_docs), rng),
                          add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
                if len(ids) < 8:
                    continue
            prompts.append(ids)
            kinds.append(kind)
            break
    return prompts, kinds
