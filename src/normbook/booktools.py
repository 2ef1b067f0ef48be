"""Small helpers the book's chapters use to put computed values into the prose.

Not part of the numerical API. ``claim`` glues a value formatted as text (never a raw float,
which would render as ``1.7e-16``) so that every number in a chapter's prose comes from a cell;
the cell asserts the claim next to it.
"""

from __future__ import annotations

import numbers
import os
import re
import sys

__all__ = ["prose", "claim", "kernel_device", "why_no_kernels", "rich_display", "show_image",
           "check",
           "layer_norm_graph",
           "check_nodes", "check_fn", "prose_words", "shown_code_lines", "without_solutions",
           "reading_minutes"]


class _Text(str):
    """A string whose repr is itself, so myst-nb's glue shows it without quotes."""

    def __repr__(self) -> str:
        return str(self)


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")
_SCIENTIFIC = re.compile(r"(-?)(\d+(?:\.\d+)?)e([+-]\d+)")


def prose(value, fmt: str = "") -> str:
    """``format(value, fmt)`` as a book prints a number in running text: scientific notation as
    ``1.7 × 10⁻¹⁶`` (never ``1.7e-16``), a real minus sign (U+2212), and an exact zero as ``0``
    (not ``0.0e+00``). Anything that is not a real number is formatted as given."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return format(value, fmt)
    if value == 0 and fmt[-1:] in ("e", "E"):
        return "0"
    text = format(value, fmt)
    match = _SCIENTIFIC.fullmatch(text)
    if match:
        sign, mantissa, exponent = match.groups()
        power = int(exponent)
        text = sign + (mantissa if power == 0 else
                       f"{mantissa} \u00d7 10{str(power).translate(_SUPERSCRIPT)}")
    return "\u2212" + text[1:] if text.startswith("-") else text


# Every claim made in this process, name -> text: how ``make notebooks`` writes the glued
# values into a notebook's prose without the book's build (book/_ext/notebooks.py).
CLAIMED: dict[str, str] = {}


def claim(name: str, value, fmt: str = ""):
    """Glue ``prose(value, fmt)`` under ``name`` for ``{glue}`name``` in the prose; return ``value``.

    Outside a notebook kernel (plain python, pytest) it only records the text in ``CLAIMED``
    and returns the value.
    """
    text = _Text(prose(value, fmt))
    CLAIMED[name] = str(text)
    try:
        from myst_nb import glue
    except ImportError:  # pragma: no cover - myst-nb is a book dependency only
        return value
    glue(name, text, display=False)
    return value


def kernel_device() -> str:
    """Where a chapter's kernel cells put their tensors: ``"cuda"`` where a CUDA GPU and Triton
    are both present and Triton's interpreter is off (the kernels compile for that GPU), else
    ``"cpu"`` (with ``TRITON_INTERPRET=1`` set before Triton is imported the interpreter runs
    them there; without Triton the cells skip, see :func:`why_no_kernels`)."""
    import importlib.util

    import torch

    if (importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return "cuda"
    return "cpu"


def _triton_interprets() -> bool:
    """Whether the imported Triton runs @triton.jit functions in its interpreter: its own
    helpers, decorated when triton.language was imported, tell (True where none is found)."""
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return True
    helper = getattr(standard, "sigmoid", None)
    return helper is None or isinstance(helper, InterpretedFunction)


def why_no_kernels() -> str | None:
    """Why a chapter's kernel cells skip here, in a few words a cell prints, or None where they
    run: Triton installed, and a CUDA GPU or Triton's interpreter on.

    Without a GPU, and before anything has imported Triton (which reads ``TRITON_INTERPRET``
    once), it turns the interpreter on, unless the environment already says otherwise: a
    downloaded chapter then runs its kernels on a laptop or a CPU-only notebook service, as
    the book build does. Call it before the chapter imports :mod:`normbook.kernels`.

    The reasons: Triton is not installed; or there is no GPU and the interpreter is off,
    because the environment sets ``TRITON_INTERPRET`` to something other than 1, or because
    Triton was imported before it could be turned on."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return ("Triton is not installed (Linux only: pip install -e '.[kernels]' in a clone, or "
                "pip install 'normbook[kernels] @ git+https://github.com/normbook/normbook')")
    import torch

    if torch.cuda.is_available():
        return None
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    value = os.environ.get("TRITON_INTERPRET")
    if value == "1":
        if "triton" in sys.modules and not _triton_interprets():
            return ("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set "
                    "(restart with it set first)")
        return None
    if value is None:
        return "no GPU, and Triton was imported before TRITON_INTERPRET=1 was set"
    return f"no GPU, and TRITON_INTERPRET={value!r} turns Triton's interpreter off"


def rich_display():
    """``(Markdown, display)`` for a chapter's tables: IPython's in a notebook (Jupyter, Colab,
    the book build), ``(str, print)`` elsewhere. A chapter run as a plain script (``jupyter
    nbconvert --to script``, then ``python``) has IPython installed (the ``book`` extra) but no
    IPython running, and there IPython's ``display`` prints ``<IPython.core.display.Markdown
    object>`` in place of each table: this prints the table's Markdown text."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        return str, print
    if get_ipython() is None:
        return str, print
    return Markdown, display


def show_image(path) -> None:
    """Show an image file under a chapter's cell where IPython runs; elsewhere (a plain script,
    see :func:`rich_display`) print its path."""
    markdown, display = rich_display()
    if display is print:
        print("figure:", path)
        return
    from IPython.display import Image

    display(Image(str(path)))


def check(name: str, yours, reference, *, x=None, dy=None, weight=None,
          eps: float | None | str = "default", kind: str = "layer") -> bool:
    """Compare a gradient you derived with a reference, as a reader checks an exercise.

    Prints one line: ``name: exact`` (bitwise equal), ``close`` (within the tolerances
    ``torch.testing.assert_close`` uses for the dtype of ``yours``, as :func:`check_fn`; given
    a float64 ``x`` and reference, ``yours`` must be float64 too) or
    ``WRONG``, with the largest absolute difference (or the
    shape expected, where yours has another). Given the
    forward's ``x`` and ``dy`` (and ``weight``), ``yours`` is also put to the identities that
    need no reference (:func:`normbook.checks.assert_layer_norm_identities`, or
    :func:`~normbook.checks.assert_rms_norm_identities` for ``kind="rms"``), and the line ends
    with ``identities hold`` or the one that fails (``shift identity fails``, ``scale identity
    fails``).

    Args:
        name: what is compared, printed first.
        yours, reference: tensors of one shape (``yours`` is the input gradient dx when x is
            given).
        x, dy: (..., D) the forward's input and the gradient at y, or None for no identities.
        weight: (D,) or None.
        eps: the forward's eps: a number; None, RMSNorm's default (the machine epsilon of
            the compute dtype); ``"default"``, torch's default of the kind (1e-5 for
            ``"layer"``, None for ``"rms"``).
        kind: ``"layer"`` or ``"rms"`` (else a ValueError: any other word ran LayerNorm's
            identities on an RMSNorm gradient).

    Returns:
        bool: True when ``yours`` is exact or close and (with x) the identities hold.
    """
    import torch

    from normbook import checks

    eps = checks._kind_eps(kind, eps, x.dtype if torch.is_tensor(x) else torch.float32)
    if not torch.is_tensor(yours) or tuple(yours.shape) != tuple(reference.shape):
        got = (f"the shape {tuple(yours.shape)}" if torch.is_tensor(yours)
               else f"a {type(yours).__name__}")
        print(f"{name}: WRONG; expected a tensor of the shape {tuple(reference.shape)}, got "
              f"{got}")          # (a line, as check_fn's, rather than an error in the cell)
        return False
    if (torch.is_tensor(x) and x.dtype == torch.float64 and reference.dtype == torch.float64
            and yours.dtype != torch.float64):
        print(f"{name}: WRONG; {_narrowed(yours.dtype)}")
        return False
    exact = bool(torch.equal(yours, reference))
    # at the dtype's tolerances, as check_fn (allclose's own, rtol 1e-5 and atol 1e-8, called
    # torch's correct float32 gradient of a 4096-wide row WRONG in about half the seeds)
    default = _TOLERANCES.get(str(yours.dtype), (1e-7, 1e-7))
    close = exact or bool(torch.allclose(yours.double(), reference.double(), rtol=default[0],
                                         atol=default[1]))
    diff = (yours.double() - reference.double()).abs().max().item() if yours.numel() else 0.0
    verdict = "exact" if exact else ("close" if close else "WRONG")
    line = f"{name}: {verdict}, max difference {prose(diff, '.1e')}"
    ok = close
    if x is not None:
        if dy is None:
            raise ValueError(f"{name}: the identities need dy as well as x")
        assert_identities = (checks.assert_rms_norm_identities if kind == "rms"
                             else checks.assert_layer_norm_identities)
        try:
            assert_identities(x, dy, weight, yours, eps)
            line += "; identities hold"
        except AssertionError as failure:              # "scale identity sum(...) fails: ..."
            line += f"; {' '.join(str(failure).split()[:2])} fails"
            ok = False
    print(line)
    return ok


NODES = ("xhat", "r", "v", "xc", "mu", "x")   # LayerNorm's graph, from the output back


def layer_norm_graph(D: int = 6, eps: float = 1e-5, seed: int = 0) -> dict:
    """One token through LayerNorm's graph, node by node, in float64, with autograd's gradient
    at every node: the forward mu = mean(x) (ln-mean), xc = x - mu, v = mean(xc^2) (ln-var),
    r = (v + eps)^(-1/2) (ln-rstd), xhat = xc r (ln-xhat), y = weight * xhat + bias (ln-y),
    and the backward of a random gradient g at y.

    Returns a dict: the inputs ``x``, ``weight``, ``bias``, ``g``, ``eps`` and ``values`` (each
    node's value) and ``grads`` (autograd's dL/dnode for each node of :data:`NODES`, a (D,)
    tensor or a scalar)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    x = (3 * torch.randn(D, generator=gen, **f64) + 1).requires_grad_()
    weight, bias, g = (torch.randn(D, generator=gen, **f64) for _ in range(3))
    mu = x.mean()
    xc = x - mu
    v = (xc * xc).mean()
    r = (v + eps) ** -0.5
    xhat = xc * r
    nodes = dict(xhat=xhat, r=r, v=v, xc=xc, mu=mu)
    for t in nodes.values():
        t.retain_grad()
    (weight * xhat + bias).backward(g)
    nodes["x"] = x
    return dict(x=x.detach(), weight=weight, bias=bias, g=g, eps=eps,
                values={k: t.detach() for k, t in nodes.items()},
                grads={k: t.grad for k, t in nodes.items()})


def check_nodes(fn, D: int = 6, seed: int = 0) -> bool:
    """Check a hand backward through LayerNorm's graph node by node, as the node-by-node
    exercise asks: ``fn(g, weight, x, eps)`` returns a dict of your dL/dnode for the nodes of
    :data:`NODES` (None for one not written yet). Prints a line per node, ``matches``, ``not
    yet written`` or ``WRONG`` with the largest difference from autograd's; True when every
    node matches.

    Args:
        fn: your function of (g (D,), weight (D,), x (D,), eps).
        D, seed: the token's size and the random draw (float64).
    """
    import torch

    graph = layer_norm_graph(D, seed=seed)
    yours = fn(graph["g"], graph["weight"], graph["x"], graph["eps"])
    missing = [k for k in NODES if k not in yours]
    if missing:
        raise ValueError(f"check_nodes: expected a dict with the nodes {', '.join(NODES)}, "
                         f"missing {', '.join(missing)}")
    ok = True
    for node in NODES:
        want, got = graph["grads"][node], yours[node]
        if got is None:
            print(f"d_{node}: not yet written")
            ok = False
            continue
        if torch.is_tensor(got) and got.is_floating_point() and got.dtype != torch.float64:
            # the graph is float64: a float32 gradient misses rtol 1e-10 by rounding alone
            print(f"d_{node}: WRONG dtype, expected torch.float64 (the graph's), got "
                  f"{got.dtype}")
            ok = False
            continue
        got = torch.as_tensor(got, dtype=torch.float64)
        if got.shape != want.shape:
            print(f"d_{node}: WRONG shape, expected {tuple(want.shape)}, got {tuple(got.shape)}")
            ok = False
            continue
        diff = (got - want).abs().max().item()
        good = bool(torch.allclose(got, want, rtol=1e-10, atol=1e-12))
        print(f"d_{node}: {'matches' if good else 'WRONG'}, max difference {prose(diff, '.1e')}")
        ok = ok and good
    return ok


# Tolerances for a result of each float dtype, as torch.testing.assert_close's defaults; every
# other number (float64, Python's, integers) is held to float64's.
_TOLERANCES = {"torch.float16": (1e-3, 1e-5), "torch.bfloat16": (1.6e-2, 1e-5),
               "torch.float32": (1.3e-6, 1e-5)}
_HALVES = {"torch.float16", "torch.bfloat16"}


def _narrowed(dtype) -> str:
    """Why an answer of ``dtype`` to float64 inputs and a float64 reference is WRONG (check,
    check_fn): judged at its own dtype's tolerance, float32 passed eps outside the root."""
    return (f"expected the dtype torch.float64 of the inputs, got {dtype} (a float32 tensor "
            f"made inside the function?)")


def _unwritten(value) -> bool:
    """Whether a result is a stub's: None, or a tuple, list or dict holding None."""
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_unwritten(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_unwritten(v) for v in value)
    return False


def _compare(got, want, rtol, atol, wide: bool = False) -> tuple[bool, float | None, str | None]:
    """(matches, largest difference of the numbers compared or None, why not) for one result
    against the reference's, piece by piece. ``wide``: the inputs were float64, so a float64
    reference wants float64 back (see :func:`check_fn`)."""
    import torch

    if isinstance(want, (dict, tuple, list)):
        if isinstance(want, dict):
            if not isinstance(got, dict) or set(got) != set(want):
                return False, None, f"expected a dict with the keys {sorted(want)}"
            pairs = [(f"{k!r}", got[k], want[k]) for k in want]
        else:
            if not isinstance(got, (tuple, list)) or len(got) != len(want):
                return False, None, (f"expected {len(want)} value"
                                     + "s" * (len(want) != 1))
            pairs = [(f"value {i} of {len(want)}", g, w)
                     for i, (g, w) in enumerate(zip(got, want), 1)]
        ok, diff, why = True, None, None
        for name, g, w in pairs:
            one_ok, one_diff, one_why = _compare(g, w, rtol, atol, wide)
            if not one_ok and why is None:
                # which piece: "value 2 of 3 is off by up to 2e-3", not only the largest
                # difference of all of them
                why = f"{name}: {one_why}" if one_why else (
                    f"{name} is off" + (f" by up to {prose(one_diff, '.1e')}"
                                        if one_diff is not None else ""))
            ok = ok and one_ok
            if one_diff is not None:
                diff = one_diff if diff is None else max(diff, one_diff)
        return ok, diff, why
    numeric = (torch.is_tensor(want) or hasattr(want, "__array__")
               or (isinstance(want, numbers.Number) and not isinstance(want, bool)))
    if not numeric:
        return got == want, None, None if got == want else f"expected {want!r}, got {got!r}"
    try:
        w = torch.as_tensor(want)
        # Python's floats are doubles: a list of them is not a float32 answer
        g = (torch.as_tensor(got) if torch.is_tensor(got) or hasattr(got, "__array__")
             or not w.is_floating_point() else torch.as_tensor(got, dtype=torch.float64))
    except (TypeError, ValueError, RuntimeError):
        return False, None, f"expected a number or a tensor, got {type(got).__name__}"
    if g.shape != w.shape:
        return False, None, f"expected the shape {tuple(w.shape)}, got {tuple(g.shape)}"
    if wide and w.dtype == torch.float64 and g.is_floating_point() and g.dtype != w.dtype:
        # float64 in, float64 out: an answer rounded to float32 on the way was judged at
        # float32's tolerance, which passed eps outside the root and eps left out
        return False, None, _narrowed(g.dtype)
    if str(w.dtype) in _HALVES and g.dtype != w.dtype:
        # a reference in float16 or bfloat16 asks for that dtype back: a float32 answer
        # would otherwise pass, at float32's tolerances, where the exercise wants the
        # rounding to the half type (a wider reference takes any float: float32 against
        # float64, or a half answer at its own tolerances)
        return False, None, f"expected the dtype {w.dtype}, got {g.dtype}"
    if g.is_complex() or w.is_complex():
        g, w = g.to(torch.complex128), w.to(torch.complex128)
    else:
        g, w = g.double(), w.double()
    if not g.numel():
        return True, 0.0, None
    default = _TOLERANCES.get(str(torch.as_tensor(got).dtype) if torch.is_tensor(got)
                              or hasattr(got, "__array__") else "torch.float64", (1e-7, 1e-7))
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    diff = (g - w).abs().max().item()
    return bool(torch.allclose(g, w, rtol=rtol, atol=atol)), diff, None


def check_fn(name: str, yours, reference, *inputs, rtol: float | None = None,
             atol: float | None = None) -> bool:
    """Run the reader's function on an exercise's inputs and compare its result with a
    reference's, as an exercise that checks the reader's own code does before its solution.

    ``yours(*inputs)`` is the reader's function. A stub, one that raises NotImplementedError or
    returns None (or a tuple, list or dict holding None), is ``not yet written``, so that a page
    runs cleanly with the exercise left blank. ``reference`` is a function called on the same
    inputs, or the expected result itself. The two results are compared piece by piece: a tuple,
    list or dict item by item; tensors, arrays and numbers with ``torch.allclose`` at the
    tolerances ``torch.testing.assert_close`` uses for the dtype of ``yours`` (float64's for
    Python numbers and lists of them), or ``rtol`` and ``atol``; anything else, a string say,
    with ``==``. Where an input is a float64 tensor, a float64 reference wants float64 back: a
    float32 answer is WRONG whatever its values (at float32's tolerance eps outside the root
    passed).

    Prints one line: ``name: matches`` or ``name: WRONG``, with the largest difference of the
    numbers compared or what does not fit (a shape, a number of values), naming the piece of a
    tuple, list or dict that is off ("value 2 of 3 is off by up to 0.002"), or ``name: not yet
    written``.

    Returns:
        bool: True when your result matches the reference's.
    """
    try:
        got = yours(*inputs)
    except NotImplementedError:
        got = None
    if _unwritten(got):
        print(f"{name}: not yet written")
        return False
    import torch

    want = reference(*inputs) if callable(reference) else reference
    wide = any(torch.is_tensor(t) and t.dtype == torch.float64 for t in inputs)
    ok, diff, why = _compare(got, want, rtol, atol, wide)
    line = f"{name}: {'matches' if ok else 'WRONG'}"
    if diff is not None and why is None:    # (a difference of the parts that fit misleads)
        line += f", max difference {prose(diff, '.1e')}"
    if why is not None:
        line += f"; {why}"
    print(line)
    return ok


# ---- reading times: the book's front page and the chapters' sittings count with these --------

def prose_words(text: str) -> int:
    """Words a reader reads in a MyST page: not code, not markup; each equation or glued value
    is one word."""
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)        # jupytext front matter
    words, skip, in_math = 0, None, False
    for line in text.splitlines():
        fence = re.match(r"\s*(`{3,}|:{3,})(.*)", line)
        if skip:                                   # inside a code cell or a code block
            if fence and fence.group(1) == skip and not fence.group(2).strip():
                skip = None
            continue
        if line.lstrip().startswith("$$"):         # a displayed equation: one word
            words += not in_math
            in_math = not in_math and line.strip().count("$$") == 1
            continue
        if in_math:
            continue
        if fence:
            info = fence.group(2).strip()
            if info.startswith("{code-cell}") or (info and not info.startswith("{")):
                skip = fence.group(1)
            continue                               # a directive's fence is markup
        if re.match(r"\s*:[\w-]+:", line) or re.match(r"\s*\([\w-]+\)=\s*$", line):
            continue                               # directive options, labels
        line = re.sub(r"\{[\w:-]+\}`[^`]*`|`[^`]*`|\$[^$]+\$", " w ", line)
        words += len(re.findall(r"[A-Za-z0-9][\w'’.-]*", line))
    return words


def shown_code_lines(text: str) -> int:
    """Lines of the code cells a reader sees unfolded in a MyST page (not removed, not
    hidden)."""
    cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", text, re.S | re.M)
    lines = 0
    for body in cells:
        head = body.split("\n---\n", 1)[0] if body.startswith("---") else body[:200]
        if re.search(r"remove-cell|hide-input|remove-input", head):
            continue
        lines += sum(1 for line in body.splitlines()
                     if line.strip() and not line.startswith(":tags:"))
    return lines


def without_solutions(text: str) -> str:
    """A MyST page without its exercises' solutions (``solution-start`` to ``solution-end``,
    and ``{solution}`` directives): what a reader reads, while the solutions belong to the time
    spent working the exercises."""
    text = re.sub(r"^```\{solution-start\}.*?^```\{solution-end\}\n```[ \t]*$", "", text,
                  flags=re.S | re.M)
    return re.sub(r"^(`{3,}|:{3,})\{solution\}.*?^\1[ \t]*$", "", text, flags=re.S | re.M)


def reading_minutes(text: str, words_per_minute: int = 120, lines_per_minute: int = 10) -> float:
    """Minutes to read a MyST page (or a part of one), its exercises' solutions left out: its
    prose at ``words_per_minute`` (120: prose dense with equations) and its unfolded code at
    ``lines_per_minute``."""
    text = without_solutions(text)
    return prose_words(text) / words_per_minute + shown_code_lines(text) / lines_per_minute
