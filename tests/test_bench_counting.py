"""normbook.bench.counting: launches and passes of a composition against one fused op."""

import torch

from normbook.bench.counting import CountPasses, count, fused_passes


def test_count_passes_sees_each_op_and_skips_views():
    x = torch.randn(8, 16)
    with CountPasses(x.numel()) as c:
        y = (x - x.mean(-1, keepdim=True)).view(16, 8) * 2.0
    assert y.shape == (16, 8)
    assert c.ops == 3                     # mean, sub, mul; the view moves no data
    assert (c.reads, c.writes) == (3, 2)  # x by mean and sub, the difference by mul; two full outputs


def test_the_composition_costs_more_passes_than_the_fused_op():
    (naive_ops, naive_passes), (_, naive_bwd_passes) = count("naive", "layer_norm")
    (torch_ops, torch_passes), (torch_bwd_ops, _) = count("torch", "layer_norm")
    assert fused_passes("layer_norm", "fwd") == 2 and fused_passes("layer_norm", "bwd") == 3
    assert torch_ops == 1 and torch_bwd_ops == 1 and torch_passes == 2
    assert naive_ops >= 5 and naive_passes >= 3 * fused_passes("layer_norm", "fwd")
    assert naive_bwd_passes > 3 * fused_passes("layer_norm", "bwd")

