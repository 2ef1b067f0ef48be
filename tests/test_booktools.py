"""normbook.booktools.prose: how the book prints a computed number in running text."""

from __future__ import annotations

import numpy as np

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
