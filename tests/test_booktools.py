"""normbook.booktools.prose: how the book prints a computed number in running text."""

from __future__ import annotations

import os

import numpy as np
import pytest

from normbook.booktools import prose


def test_scientific_notation_reads_as_a_power_of_ten():
    assert prose(1.7e-16, ".1e") == "1.7 \u00d7 10\u207b\u00b9\u2076"
    assert prose(12345.0, ".2e") == "1.23 \u00d7 10\u2074"
    assert prose(np.float64(-2.5e-7), ".1e") == "\u22122.5 \u00d7 10\u207b\u2077"
    assert prose(4.0, ".1e") == "4.0"                  # 4.0e+00: no "x 10^0"


def test_minus_sign_and_zero():
    assert prose(-0.5, ".2f") == "\u22120.50" and prose(-3, "d") == "\u22123"
    assert prose(0.0, ".1e") == "0" and prose(0.0, ".2f") == "0.00"
    assert prose(0.25, ".0%") == "25%"


def test_anything_else_is_formatted_as_given():
    assert prose("shift, scale") == "shift, scale" and prose(True) == "True" and prose(7) == "7"


def _ln_grad(kind):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, generator=g)
    dy = torch.randn(4, 16, dtype=torch.float64, generator=g)
    f = torch.nn.functional
    y = f.layer_norm(x, (16,), w, None, 1e-5) if kind == "layer" else f.rms_norm(x, (16,), w, 1e-5)
    (dx,) = torch.autograd.grad(y, x, dy)
    return x.detach(), dy, w, dx


def test_check_says_exact_close_or_wrong_and_names_the_failing_identity(capsys):
    import pytest

    from normbook.booktools import check

    x, dy, w, dx = _ln_grad("layer")
    assert check("dx", dx, dx, x=x, dy=dy, weight=w)
    assert capsys.readouterr().out == "dx: exact, max difference 0; identities hold\n"
    assert check("dx", dx * (1 + 1e-12), dx)                   # no identities without x
    assert "dx: close, max difference" in capsys.readouterr().out
    assert not check("dx", dx * 1.01, dx, x=x, dy=dy, weight=w)   # a wrong factor
    out = capsys.readouterr().out
    assert out.startswith("dx: WRONG, max difference ") and out.endswith("; scale identity fails\n"), out
    assert not check("dx", dx + 0.1, dx, x=x, dy=dy, weight=w)    # a constant left in
    assert "shift identity" in capsys.readouterr().out
    x, dy, w, dx = _ln_grad("rms")
    assert check("rms dx", dx, dx.clone(), x=x, dy=dy, weight=w, eps=1e-5, kind="rms")
    assert "identities hold" in capsys.readouterr().out
    # a wrong shape, or not a tensor: a WRONG line, as check_fn's, not an error in the cell
    assert not check("dx", dx[:2], dx)
    assert capsys.readouterr().out == (f"dx: WRONG; expected a tensor of the shape "
                                       f"{tuple(dx.shape)}, got the shape {tuple(dx[:2].shape)}\n")
    assert not check("dx", dx.tolist(), dx)
    assert capsys.readouterr().out.endswith("got a list\n")


def _nodes(g, weight, x, eps, wrong=False):
    D = x.numel()
    xc = x - x.mean()
    v = (xc * xc).mean()
    r = (v + eps) ** -0.5
    d_xhat = g * weight
    d_r = (d_xhat * xc).sum()
    d_v = d_r * -0.5 * (v + eps) ** -1.5
    d_xc = d_xhat * r + d_v * 2 * xc / D
    d_mu = -d_xc.sum() * (2 if wrong else 1)
    return dict(xhat=d_xhat, r=d_r, v=d_v, xc=d_xc, mu=d_mu, x=d_xc + d_mu / D)


def test_check_judges_float32_at_float32_s_tolerances(capsys):
    """torch's own float32 LayerNorm gradient of 4096-wide rows against float64's: check
    compared them with allclose's fixed rtol 1e-5 and atol 1e-8, and printed WRONG in about
    half the seeds (its docstring promised the dtype's tolerances); now close, as check_fn
    says, with the identities holding; a gradient off by 1e-3 is still WRONG."""
    import torch
    import torch.nn.functional as F

    from normbook import booktools

    D = 4096
    for seed in range(4, 8):
        g = torch.Generator().manual_seed(seed)
        x64 = 3 * torch.randn(8, D, generator=g, dtype=torch.float64) + 1
        w64 = torch.randn(D, generator=g, dtype=torch.float64)
        dy64 = torch.randn(8, D, generator=g, dtype=torch.float64)

        def dx(dt):
            x = x64.to(dt).requires_grad_()
            return torch.autograd.grad(F.layer_norm(x, (D,), w64.to(dt), None, 1e-5), x,
                                       dy64.to(dt))[0]

        want, got = dx(torch.float64), dx(torch.float32)
        assert booktools.check("dx", got, want, x=x64.float(), dy=dy64.float(),
                               weight=w64.float())
        assert capsys.readouterr().out.startswith("dx: close")
        assert not booktools.check("dx", got * (1 + 1e-3), want)
        assert capsys.readouterr().out.startswith("dx: WRONG")


def test_check_takes_each_kinds_default_eps_and_refuses_another_kind(capsys):
    """kind="rms" with the old default eps of 1e-5 failed torch's own RMSNorm gradient (eps
    None there); kind="RMS" quietly ran LayerNorm's identities on it."""
    import torch
    import torch.nn.functional as F

    from normbook.booktools import check

    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xg = x.clone().requires_grad_()
    dx, = torch.autograd.grad(F.rms_norm(xg, (16,)), xg, dy)
    assert check("dx", dx, dx.clone(), x=x, dy=dy, kind="rms")
    assert check("dx", dx, dx.clone(), x=x, dy=dy, eps=None, kind="rms")
    assert "identities hold" in capsys.readouterr().out
    for kind in ("RMS", "ln"):
        with pytest.raises(ValueError, match=f'kind: expected "layer" or "rms", got {kind!r}'):
            check("dx", dx, dx.clone(), x=x, dy=dy, kind=kind)


def test_check_nodes_says_which_node_is_wrong(capsys):
    """The node-by-node exercise's check: blanks are 'not yet written', a wrong node is WRONG
    (and so is every node it feeds), a right backward matches at every node."""
    from normbook.booktools import NODES, check_nodes

    assert not check_nodes(lambda *a: dict.fromkeys(NODES))
    assert capsys.readouterr().out.count("not yet written") == len(NODES)
    assert check_nodes(_nodes, D=9, seed=3)
    assert capsys.readouterr().out.count("matches") == len(NODES)
    assert not check_nodes(lambda *a: _nodes(*a, wrong=True))
    out = capsys.readouterr().out
    assert "d_mu: WRONG" in out and "d_x: WRONG" in out and "d_xc: matches" in out
    with pytest.raises(ValueError, match="missing mu"):
        check_nodes(lambda *a: {k: None for k in NODES if k != "mu"})
    # a right backward in float32 says so, not only WRONG by a rounding-sized difference
    assert not check_nodes(lambda *a: {k: (v.float() if k == "xhat" else v)
                                       for k, v in _nodes(*a).items()})
    assert "d_xhat: WRONG dtype, expected torch.float64 (the graph's), got torch.float32" in \
        capsys.readouterr().out


def test_check_fn_says_not_yet_written_matches_or_wrong(capsys):
    """The generic exercise check: a stub (NotImplementedError, None, None inside a tuple) is
    'not yet written' and the call does not raise; a result matches the reference's to the
    tolerances of its dtype, piece by piece; what does not fit says why."""
    import torch

    from normbook.booktools import check_fn

    def stub(x):
        raise NotImplementedError

    x = torch.linspace(-1, 1, 7, dtype=torch.float64)
    for yours in (stub, lambda x: None, lambda x: (x, None), lambda x: {"a": None}):
        assert not check_fn("f", yours, torch.tanh, x)
        assert capsys.readouterr().out == "f: not yet written\n"
    assert check_fn("tanh", lambda x: torch.sinh(x) / torch.cosh(x), torch.tanh, x)
    assert capsys.readouterr().out.startswith("tanh: matches, max difference ")
    assert not check_fn("tanh", lambda x: x, torch.tanh, x)
    assert capsys.readouterr().out.startswith("tanh: WRONG, max difference 2.4")
    # float32 is held to float32's tolerance, float64 to float64's
    assert check_fn("f32", lambda x: x * (1 + 1e-7), lambda x: x, x.float())
    capsys.readouterr()
    # float64 inputs want float64 back: a float32 answer passed at float32's tolerance (a
    # student's eps outside the root did, found 2026-12-08), whatever its values; a list of
    # Python floats is float64's
    assert not check_fn("f32", lambda x: x.float(), lambda x: x, x)
    assert capsys.readouterr().out == ("f32: WRONG; expected the dtype torch.float64 of the "
                                       "inputs, got torch.float32 (a float32 tensor made "
                                       "inside the function?)\n")
    assert check_fn("list", lambda x: x.tolist(), lambda x: x, x)
    assert not check_fn("list", lambda x: (x * (1 + 1e-6)).tolist(), lambda x: x, x)
    assert not check_fn("f64", lambda x: x * (1 + 1e-6), lambda x: x, x)
    assert check_fn("loose", lambda x: x * (1 + 1e-6), lambda x: x, x, rtol=1e-5)
    capsys.readouterr()
    # pieces: tuples, dicts, numbers, strings; a reference given as its value
    assert check_fn("pair", lambda: (1.0, {"s": "nd->n", "t": x}), (1, {"s": "nd->n", "t": x}))
    assert capsys.readouterr().out == "pair: matches, max difference 0\n"
    assert not check_fn("s", lambda: "nd->d", "nd->n")
    assert capsys.readouterr().out == "s: WRONG; expected 'nd->n', got 'nd->d'\n"
    assert not check_fn("n", lambda: (x, x), (x,))
    assert capsys.readouterr().out == "n: WRONG; expected 1 value\n"
    assert not check_fn("shape", lambda: x[:3], x)
    assert capsys.readouterr().out == "shape: WRONG; expected the shape (7,), got (3,)\n"
    assert not check_fn("nan", lambda: x / 0 * 0, x)         # NaN is never close
    assert "nan: WRONG" in capsys.readouterr().out
    # a reference in float16 wants float16 back: float32 is WRONG, whatever the values; a
    # float64 reference takes a float32 or float16 answer, at that answer's tolerances
    h = x.half()
    assert not check_fn("half", lambda: h.float(), h)
    assert capsys.readouterr().out == "half: WRONG; expected the dtype torch.float16, got torch.float32\n"
    assert check_fn("half", lambda: h, x)
    capsys.readouterr()
    # one part of the wrong shape: no 'max difference' of the parts that fit
    assert not check_fn("parts", lambda: (x, x[:2]), (x, x))
    assert capsys.readouterr().out == "parts: WRONG; value 2 of 2: expected the shape (7,), got (2,)\n"
    # which piece is off, not only the largest difference of them all (m, c2 or dweight?)
    assert not check_fn("three", lambda: (x, 2 * x, {"m": x}), (x, x, {"m": x}))
    assert capsys.readouterr().out == "three: WRONG; value 2 of 3 is off by up to 1.0\n"
    assert not check_fn("keyed", lambda: {"m": x, "c2": x + 1}, {"m": x, "c2": x})
    assert capsys.readouterr().out == "keyed: WRONG; 'c2' is off by up to 1.0\n"


def test_all_lists_every_public_helper():
    """``from normbook.booktools import *`` gives every public helper and nothing else (the
    module's own imports stay out)."""
    from normbook import booktools
    defined = {n for n, o in vars(booktools).items()
               if callable(o) and not n.startswith("_")
               and getattr(o, "__module__", "") == booktools.__name__}
    assert set(booktools.__all__) == defined


def test_turning_the_interpreter_on_after_triton_is_named():
    """TRITON_INTERPRET=1 set after triton was imported: Triton reads it once, so its own
    helpers stay compiled while normbook's kernels are interpreted, and a launch failed deep
    in Triton. why_no_kernels said the kernels would run; now it says why not, and the first
    kernel call raises a one-line RuntimeError (a fresh user's trial)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = (
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import normbook\n"
        "from normbook.booktools import why_no_kernels\n"
        "print(why_no_kernels())\n"
        "with normbook.backend('kernels'):\n"
        "    try:\n"
        "        normbook.layer_norm(torch.randn(2, 8), 8)\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
        "from normbook.kernels import minimal\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""            # a machine without a GPU, even on one
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    said, raised = r.stdout.strip().splitlines()
    assert said.startswith("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set")
    assert raised.startswith("input: TRITON_INTERPRET=1 was set after triton was imported")


def test_rich_display_prints_text_where_no_ipython_runs(monkeypatch):
    """A chapter run as a plain script has IPython installed but not running: IPython's display
    would print "<IPython.core.display.Markdown object>" for each table."""
    import IPython

    from normbook.booktools import rich_display

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert rich_display() == (str, print)
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())    # a running kernel
    markdown, display = rich_display()
    from IPython.display import Markdown, display as ipython_display
    assert (markdown, display) == (Markdown, ipython_display)
