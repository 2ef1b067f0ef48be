"""Chapters that follow the reader's device (issue 24): the kernel cells of chapter 9 and the
appendix put their tensors where ``booktools.kernel_device`` says (the GPU when there is one),
and ``benchmarks/gpu_check.sh`` can run chapter 9 there without jupytext.

CI has no GPU, so the device path is exercised as far as a CPU allows: the choice itself (with
CUDA and Triton stood in) and every tensor a kernel cell creates (read from the source) here;
the chapter run top to bottom by the reader gpu_check.sh uses, in the interpreter, by
``make gpu-dry-run`` (its ``chapter`` step; a failing cell or claim fails make test)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from normbook import booktools

ROOT = Path(__file__).resolve().parents[1]
KERNEL_PAGES = ["09-kernels", "appendix-kernels"]
FACTORIES = {"randn", "rand", "zeros", "ones", "empty", "full", "arange", "tensor", "randint",
             "linspace", "eye"}


def test_kernel_device_follows_the_gpu(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert booktools.kernel_device() == "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # the interpreter takes CPU tensors
    assert booktools.kernel_device() == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert booktools.kernel_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert booktools.kernel_device() == "cpu"            # no Triton: the cells skip


def test_why_no_kernels_turns_the_interpreter_on_without_a_gpu(monkeypatch):
    """A downloaded chapter on a machine with Triton and no GPU: the kernel cells run in the
    interpreter (set before Triton is imported), unless the environment turned it off or
    Triton was imported already (too late: it reads the switch once)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert booktools.why_no_kernels() is None and booktools.kernel_device() == "cpu"
    assert __import__("os").environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # the reader's own choice stands
    assert booktools.why_no_kernels() == "no GPU, and TRITON_INTERPRET='0' turns Triton's interpreter off"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setitem(sys.modules, "triton", object())  # imported already, compiled mode
    assert "imported before TRITON_INTERPRET=1" in booktools.why_no_kernels()
    assert "TRITON_INTERPRET" not in __import__("os").environ
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert booktools.why_no_kernels().startswith("Triton is not installed")   # the cells skip


def _notebooks():
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    return importlib.import_module("notebooks")


def _kernel_blocks(tree: ast.AST):
    """The bodies of ``if HAS_TRITON:`` and ``if DEVICE == "cuda":`` blocks."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "HAS_TRITON" in ast.unparse(node.test) \
                or isinstance(node, ast.If) and "DEVICE" in ast.unparse(node.test):
            yield from node.body


@pytest.mark.parametrize("stem", KERNEL_PAGES)
def test_kernel_cells_create_their_tensors_on_the_chosen_device(stem):
    cells = _notebooks().code_cells(ROOT / "book" / f"{stem}.md")
    found, offending = 0, []
    for cell in cells:
        source = "\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith("%"))
        for stmt in _kernel_blocks(ast.parse(source)):
            for call in ast.walk(stmt):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
                        and call.func.attr in FACTORIES):
                    found += 1
                    if not any(k.arg == "device" for k in call.keywords):
                        offending.append(ast.unparse(call))
    assert found, f"{stem}: no tensor created in a kernel cell: the test reads nothing"
    assert not offending, f"{stem}: kernel-cell tensors not on DEVICE: {offending}"


def test_the_reader_without_jupytext_sees_the_cells_jupytext_does():
    jupytext = pytest.importorskip("jupytext")
    source = ROOT / "book" / "09-kernels.md"
    ours = [c.source for c in _notebooks().code_cells(source)]
    theirs = [c.source for c in jupytext.read(source).cells if c.cell_type == "code"]
    assert ours == theirs
