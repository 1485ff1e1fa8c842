"""Review findings on device-list errors: say what is wrong and a way out that works."""

import pytest
import torch

from dpcompile.devices import parse_devices


def test_parse_devices_single_unparsable_string_says_it_cannot_be_parsed():
    """devices='gpu:0' is refused as unparsable, not with advice to pass ['gpu:0']."""
    with pytest.raises(ValueError, match="cannot parse device spec 'gpu:0'") as info:
        parse_devices("gpu:0")
    assert "['gpu:0']" not in str(info.value)


def test_parse_devices_cuda_without_gpus_names_no_index_range():
    """Without CUDA, a cuda device is refused without the empty range 'indices 0..-1'."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="repeated 'cpu' entries") as info:
        parse_devices(["cuda:0"])
    assert "0..-1" not in str(info.value)
