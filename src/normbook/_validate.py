"""Argument checks shared by the public API and the kernels.

Each check raises a ValueError or TypeError that names the argument and shows what was
expected against what was given. Where torch's norms raise a RuntimeError for the same mistake
the error is one too (measured, torch 2.13): a wrong shape or an empty normalized_shape,
:class:`ShapeError`; a parameter or residual on another device, :class:`DeviceError`; an
integer, bool or float8 input, :class:`DTypeError` (a NotImplementedError, as torch's).
"""

from __future__ import annotations

import math
import numbers
import operator

import torch


class ShapeError(ValueError, RuntimeError):
    """A tensor argument of the wrong shape (or an empty normalized_shape). A ValueError, as the
    rest of normbook's checks raise, and a RuntimeError, as torch's norms raise for the same
    mistake, so that code written against either catches it."""


class DeviceError(ValueError, RuntimeError):
    """A tensor argument on another device than the input's: a ValueError, and a RuntimeError
    as torch's norms raise (see :class:`ShapeError`)."""


class DTypeError(TypeError, NotImplementedError):
    """An input whose dtype the norms do not take (integers, bools, float8): a TypeError, and
    a NotImplementedError (so a RuntimeError) as torch's norms raise (see
    :class:`ShapeError`)."""


def as_shape(normalized_shape) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints, accepting an int, or a list, tuple or torch.Size
    of ints. An integer is what ``operator.index`` takes and not a bool, as torch takes it: a
    Python int, a numpy integer, an integer 0-d tensor, a SymInt; a float, a bool, a string
    or a tensor of dims is a TypeError (``int(8.9)`` would quietly normalize over 8 values)."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    expected = "normalized_shape: expected an int or a sequence of ints"
    if isinstance(normalized_shape, (str, bytes, bool, torch.Tensor)):   # (torch refuses a
        # tensor of dims too: "must be tuple of ints, not Tensor")
        raise TypeError(f"{expected}, got {type(normalized_shape).__name__}")
    try:
        dims = list(normalized_shape)
    except TypeError:
        raise TypeError(f"{expected}, got {type(normalized_shape).__name__}") from None
    shape = []
    for i, s in enumerate(dims):
        try:
            if isinstance(s, bool):
                raise TypeError
            # (a SymInt as it is: its __index__ would make a dynamic size a constant)
            shape.append(s if isinstance(s, torch.SymInt) else operator.index(s))
        except TypeError:
            raise TypeError(f"{expected}, got {normalized_shape!r}, whose element {i} is "
                            f"{type(s).__name__} {s!r}") from None
    if not shape:
        raise ShapeError("normalized_shape: expected at least one dimension, got ()")
    return tuple(shape)


def check_input(input: torch.Tensor, name: str = "input") -> None:
    """A floating-point tensor: normalization of integers or booleans is undefined; float8 is
    not implemented (as in torch)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(input).__name__}")
    if input.is_floating_point() and input.dtype.itemsize == 1:
        raise DTypeError(
            f"{name}: float8 inputs are not supported (expected float16, bfloat16, float32 or "
            f"float64, got {input.dtype}); cast to bfloat16 first")
    if not input.is_floating_point():
        raise DTypeError(
            f"{name}: expected a floating-point dtype (float16, bfloat16, float32, float64), "
            f"got {input.dtype}"
        )


def check_normalized_shape(input: torch.Tensor, shape: tuple[int, ...]) -> None:
    """The trailing dims of ``input`` must equal ``normalized_shape``."""
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != shape:
        raise ShapeError(
            f"normalized_shape: expected the trailing dims of input, input.shape[-{len(shape)}:] "
            f"= {tuple(input.shape[-len(shape):])}, to equal normalized_shape = {shape}; "
            f"input has shape {tuple(input.shape)}"
        )


def check_param(param, name: str, input: torch.Tensor, shape: tuple[int, ...], dtypes=None) -> None:
    """An optional affine parameter: None, or a floating tensor of ``normalized_shape`` on input's
    device; with ``dtypes``, also one of those dtypes."""
    if param is None:
        return
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(param).__name__}")
    if not param.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype, got {param.dtype}")
    if dtypes is not None and param.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        raise TypeError(f"{name}: expected {', '.join(names[:-1])} or {names[-1]}, got {param.dtype}")
    if tuple(param.shape) != shape:
        raise ShapeError(
            f"{name}: expected shape {shape} (normalized_shape), got {tuple(param.shape)}"
        )
    if param.device != input.device:
        raise DeviceError(
            f"{name}: expected a tensor on input's device {input.device}, got {param.device}"
        )


def as_eps(eps):
    """eps as a Python float: a real number or a 0-d tensor, as torch accepts (not a 1-d tensor
    of one element, which torch refuses too: measured, torch 2.13).
    A tensor that requires grad is refused, as torch refuses it (a float eps is a constant:
    no gradient could reach it). Anything else is returned unchanged for :func:`check_eps` to
    reject."""
    if (isinstance(eps, torch.Tensor) and eps.dim() == 0 and not eps.is_complex()
            and eps.dtype != torch.bool):      # (a bool tensor: refused as a bool is)
        if eps.requires_grad:
            raise TypeError("eps: expected a real number or a 0-d tensor that does not require "
                            "grad (as torch's norms), got a tensor that requires grad")
        return float(eps)
    if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
        return float(eps)
    return eps


def check_eps(eps) -> None:
    """A real number: another type is a TypeError, as torch's is (and so is a bool, which torch
    takes as 1.0 or 0.0: ``LayerNorm(D, True)`` meant something else); NaN, which torch
    accepts and returns NaN for, a ValueError. Negative values are accepted, as torch accepts
    them (the result is NaN where var + eps < 0)."""
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps: expected a real number or a 0-d tensor, got {eps!r}")
    if eps != eps:
        raise ValueError(f"eps: expected a real number other than NaN, got {eps!r}")


def check_upcast(upcast) -> None:
    """LayerNorm's ``upcast``: True, False or "ops", else a TypeError that names it."""
    if not (type(upcast) is bool or (type(upcast) is str and upcast == "ops")):
        raise TypeError(f"upcast: expected True, False or 'ops', got {upcast!r}")


def check_modes(offset, round_xhat, has_weight: bool = True, without: str = "weight None"
                ) -> float:
    """RMSNorm's ``offset`` (a real number, not a bool) and ``round_xhat`` (a bool), each a
    TypeError naming it otherwise; returns the offset as a float. A nonzero offset needs a
    weight to add to (gamma = offset + weight): without one (``has_weight`` False, the call
    described by ``without``) it is a ValueError, not an argument quietly dropped."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"offset: expected a real number, got {offset!r}")
    if type(round_xhat) is not bool:
        raise TypeError(f"round_xhat: expected a bool, got {round_xhat!r}")
    # gamma = offset + weight would be NaN or inf throughout. (Comparisons, not math.isfinite:
    # under torch.compile(dynamic=True) a default or attribute offset is a symbolic float, and
    # Dynamo cannot trace math.isfinite of one, a graph break, an error under fullgraph)
    if not -math.inf < offset < math.inf:
        raise ValueError(f"offset: expected a finite number, got {offset!r}")
    if offset and not has_weight:
        raise ValueError(f"offset: expected a weight to add it to (gamma = offset + weight), "
                         f"got offset={offset!r} with {without}; without a weight gamma is 1, "
                         f"so pass a weight or leave offset 0")
    return float(offset)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the norms reduce in, torch's "op-math" type: float64 for float64, float32 for
    every other floating dtype (torch.promote_types(dtype, torch.float32) for those, but not
    an aten op, which non-strict torch.export would record as a graph node computing nothing)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_eps(input, eps):
    """RMSNorm's eps: None means the machine epsilon of torch's compute ("op-math") type:
    fp32's for float16, bfloat16 and float32 inputs, fp64's for float64. (torch's docstring
    says the input dtype's; what it does, measured bitwise, is fp32's for half inputs.)

    A non-float ``input`` leaves eps as given, for :func:`check_input` to reject the input first.
    """
    if (eps is None and isinstance(input, torch.Tensor) and input.is_floating_point()
            and input.dtype.itemsize > 1):                    # float8: check_input says no
        return torch.finfo(compute_dtype(input.dtype)).eps
    return eps


def check_norm_args(input, normalized_shape, params: dict, eps, name: str = "input",
                    param_dtypes=None) -> tuple[int, ...]:
    """Every check of a norm's arguments, in order; returns ``normalized_shape`` as a tuple.

    ``input`` a floating tensor whose trailing dims are ``normalized_shape``; each of ``params``
    (name -> tensor or None) None or of that shape on input's device (and, with
    ``param_dtypes``, of one of those dtypes); ``eps`` a real number.
    """
    check_input(input, name)
    shape = as_shape(normalized_shape)
    check_normalized_shape(input, shape)
    for pname, p in params.items():
        check_param(p, pname, input, shape, param_dtypes)
    check_eps(eps)
    return shape
