"""A tensor-parallel program captured with torch.export checks each call against what export
fixed, as a data-parallel one does: a sequence length the example fixed is refused with the way
out (``dynamic_dims=``) instead of failing deep inside the program on a baked ``view`` size."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpcompile
from dpcompile.capture.inputs import InputMismatch
from tests.thirdparty import import_or_skip


@pytest.fixture(scope="module")
def llama():
    T = import_or_skip("transformers")
    config = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return T.LlamaForCausalLM(config).eval()


def _tp(model, devices=2, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example = {"input_ids": torch.randint(0, 64, (2, 13))}
        kwargs = kwargs if "mesh" in kwargs else {"tensor_parallel": True, **kwargs}
        return dpcompile.transform(model, ["cpu"] * devices, example_kwargs=example, frontend="export", **kwargs)


def test_a_length_export_fixed_is_refused_with_the_way_out(llama):
    pm = _tp(llama)
    ids = torch.randint(0, 64, (2, 13))
    torch.testing.assert_close(pm(input_ids=ids).logits, llama(input_ids=ids).logits)
    with pytest.raises(InputMismatch, match=r"dynamic_dims=\{'input_ids': \[1\]\}"):
        pm(input_ids=torch.randint(0, 64, (2, 12)))


def test_a_length_left_dynamic_runs_at_any_length(llama):
    pm = _tp(llama, dynamic_dims={"input_ids": [1]})
    for length in (13, 12, 9):
        ids = torch.randint(0, 64, (2, length))
        torch.testing.assert_close(pm(input_ids=ids).logits, llama(input_ids=ids).logits)


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}])  # pp x tp: the same recipe and check
def test_a_length_export_fixed_is_refused_with_the_way_out_under_dp_or_pp_with_tp(llama, mesh):
    """These lower a call of another shape again (``build_program``), whose shape propagation blamed
    ``example_inputs=``; the call is checked against what export fixed first."""
    pm = _tp(llama, devices=4, mesh=mesh)
    with pytest.raises(InputMismatch, match=r"dynamic_dims=\{'input_ids': \[1\]\}"):
        pm(input_ids=torch.randint(0, 64, (2, 12)))
