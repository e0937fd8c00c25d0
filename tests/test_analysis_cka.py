"""convit_scale/analysis/cka.py: minibatch CKA over any number of images."""

import pytest
import torch

from convit_scale.analysis.cka import MinibatchCKA


@pytest.mark.parametrize("tail", [1, 2, 3])
def test_a_tail_minibatch_of_three_or_fewer_is_left_out_not_fatal(tail):
    # analyze measures 32 images at a time: --images 33, 34, 35 leave a last minibatch the unbiased HSIC cannot use
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 + tail, 20, generator=g)
    acc, full = MinibatchCKA(1, 1), MinibatchCKA(1, 1)
    for batch in (x[:32], x[32:]):
        acc.update([batch], [batch * 2 + 1])
    full.update([x[:32]], [x[:32] * 2 + 1])
    assert acc.skipped == tail and acc.examples == 32
    assert torch.equal(acc.compute(), full.compute())
    small = MinibatchCKA(1, 1)
    small.update([x[:3]], [x[:3]])
    with pytest.raises(ValueError, match="more than 3 examples"):
        small.compute()
