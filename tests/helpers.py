"""Helpers shared by the test files (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations


def grads(fn, dy, *inputs):
    """Forward ``fn`` on fresh leaves of ``inputs``, backward with ``dy``: (y, grads)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [leaf.grad for leaf in leaves]
