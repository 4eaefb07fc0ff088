"""Eager dropout on a CPU (`bert.dropout` at a number: its own 16-bit draws, `_cpu_dropout`) is dropout: the
rate's share of the elements zeroed, the rest scaled by 1 / (1 - rate), the gradient through the same mask,
drawn from torch's seeded generator, of any shape and dtype."""

from __future__ import annotations

import pytest
import torch

from cram.model import bert


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_the_rate_of_elements_is_zeroed_and_the_rest_scaled(rate):
    x = torch.rand(1000, 1001) + 1  # no zero of its own
    torch.manual_seed(0)
    out = bert.dropout(x, rate)
    dropped = out == 0
    assert abs(float(dropped.float().mean()) - rate) < 5 * (rate * (1 - rate) / x.numel()) ** 0.5
    torch.testing.assert_close(out[~dropped], x[~dropped] / (1 - rate), rtol=1e-4, atol=0)


def test_each_element_is_dropped_alike_wherever_it_sits():
    """Every one of a 64-bit word's four 16-bit fields is uniform: no position of four is dropped more."""
    torch.manual_seed(1)
    dropped = bert.dropout(torch.ones(4, 250_000), 0.25).view(-1, 4) == 0
    shares = dropped.float().mean(dim=0)
    assert torch.all((shares - 0.25).abs() < 5 * (0.25 * 0.75 / 250_000) ** 0.5), shares


def test_the_masks_come_from_the_seeded_generator_and_differ_call_to_call():
    x = torch.ones(3, 5, 7, dtype=torch.bfloat16)  # an element count no multiple of four
    torch.manual_seed(3)
    first, second = bert.dropout(x, 0.3), bert.dropout(x, 0.3)
    torch.manual_seed(3)
    again = bert.dropout(x, 0.3)
    assert first.dtype == torch.bfloat16 and first.shape == x.shape
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_the_gradient_flows_through_the_kept_elements_alone_scaled_alike():
    x = torch.randn(64, 33, requires_grad=True)
    upstream = torch.randn(64, 33)
    torch.manual_seed(4)
    out = bert.dropout(x, 0.2)
    (grad,) = torch.autograd.grad(out, x, upstream)
    kept = out != 0
    torch.testing.assert_close(grad[kept], upstream[kept] / 0.8, rtol=1e-4, atol=0)
    assert torch.all(grad[~kept] == 0)


def test_a_rate_of_zero_returns_the_input_itself():
    x = torch.randn(4, 4)
    assert bert.dropout(x, 0.0) is x
