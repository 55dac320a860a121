"""The fenced code blocks of a Markdown file (the README), for the tests that run them
as written: each test finds its block by language and a phrase it contains, so a block
that is reworded past recognition, removed or split fails the test that runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string ("bash", "python"; "" when none)
    code: str  # the text between the fences, ending in a newline
    line: int  # 1-based line of the opening fence
    section: str  # the "## " heading above it ("" before the first)

    def __str__(self) -> str:
        return f"```{self.lang} block at README line {self.line} (## {self.section})"


def code_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order."""
    out = []
    for m in _FENCE.finditer(text):
        head = text[:m.start()]
        sections = re.findall(r"^## (.+)$", head, re.M)
        out.append(Block(m.group(1), m.group(2), head.count("\n") + 1,
                         sections[-1].strip() if sections else ""))
    return out


def find_block(text: str, lang: str, contains: str) -> Block:
    """The one ``lang`` block of ``text`` whose code contains ``contains``; ``LookupError``
    when there is none or more than one."""
    hits = [b for b in code_blocks(text) if b.lang == lang and contains in b.code]
    if len(hits) != 1:
        raise LookupError(f"expected one ```{lang} block containing {contains!r}, found "
                          f"{len(hits)}" + "".join(f"\n  {b}" for b in hits))
    return hits[0]


def commands(code: str) -> list[str]:
    """The shell commands of a bash block: backslash continuations joined, comments and
    blank lines dropped, ``a && b`` split in two.  (For reading the block: the tests run
    the block itself.)"""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()  # a comment (not inside quotes here)
        out.extend(part.strip() for part in line.split("&&") if part.strip())
    return out


def serve_script(code: str, port: int, *, speculative: bool = True) -> str:
    """The README's CPU ``serve`` block (``code``) as a bash script for a test server: the
    block as written, plus ``--port PORT --host 127.0.0.1`` on its last command (the
    block serves on vLLM's default port 8000, on every interface; a test needs a free
    port, on loopback only).  ``speculative=False``: the same command without its
    ``--speculative-config`` (the reference server).  ``ValueError`` when the block's
    last line is not a command that takes more flags, or ``--speculative-config`` is not
    where this expects it."""
    script = code.rstrip()
    if script.endswith("\\") or "--port" in script or "--host" in script:
        raise ValueError(f"cannot append --port/--host to the block:\n{code}")
    if not speculative:
        # the flag and its one (double-quoted, backslash-escaped) argument, continuation
        # backslashes before either
        plain, n = re.subn(r'\s*(\\\n\s*)?--speculative-config\s*(\\\n\s*)?"(?:[^"\\]|\\.)*"',
                           "", script)
        if n != 1 or "--speculative-config" in plain:
            raise ValueError(f"no single --speculative-config \"...\" to remove in:\n{code}")
        script = plain.rstrip()
    return f"{script} --port {port} --host 127.0.0.1\n"
