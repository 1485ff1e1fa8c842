"""Fuzzing dpcompile.load with mutations of real program.json files (see tests/tools/export_fuzz.py):
every mutation is refused with an ExportError, or loads and computes; no payload ever runs.

More mutations: ``python benchmarks/export_fuzz.py --count 20000``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from tests.thirdparty import import_or_skip
from tests.tools.export_fuzz import Base, fuzz


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _base(name, pm, folder, *args, weight=3, **kwargs) -> Base:
    out = dpcompile.export(pm, folder)
    return Base(name, out, json.loads((out / "program.json").read_text()), lambda m: m(*args, **kwargs), weight)


def bases(tmp: object, with_transformers: bool = True) -> list[Base]:
    """A DP MLP, a CNN with BatchNorm, a tensor-parallel program and (where transformers is
    installed) a BERT through the torch.export frontend, exported under ``tmp``."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))
    out = [_base("dp_mlp", dpcompile.transform(mlp, ["cpu", "cpu"]), tmp / "dp_mlp", x)]
    image = torch.randn(4, 3, 6, 6)
    out.append(_base("cnn_bn", dpcompile.transform(ConvBN(), ["cpu", "cpu"]), tmp / "cnn_bn", image))
    tp = dpcompile.transform(mlp, ["cpu", "cpu"], tensor_parallel={"0": "column", "3": "row"}, example_inputs=(x,))
    out.append(_base("tp_mlp", tp, tmp / "tp_mlp", x))
    if with_transformers:
        T = import_or_skip("transformers")
        config = T.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                              vocab_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bert = T.BertForSequenceClassification(config).eval()
            kwargs = {"input_ids": torch.randint(1, 32, (4, 6)), "attention_mask": torch.ones(4, 6, dtype=torch.long)}
            pm = dpcompile.transform(bert, ["cpu", "cpu"], example_kwargs=kwargs, frontend="export")
        out.append(_base("bert_export", pm, tmp / "bert_export", weight=1, **kwargs))
    return out


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory):
    return bases(tmp_path_factory.mktemp("fuzz_bases"))


@pytest.mark.slow
def test_load_fuzzed_programs_refuses_or_computes_and_never_runs_a_payload(fuzz_bases, tmp_path):
    """1000 seeded mutations over four real programs: each is an ExportError at load, or loads and
    computes; the marker every payload would write never appears, nor does any other file."""
    assert all(not (b.folder / "program.pkl").exists() for b in fuzz_bases)  # all four are data
    marker = tmp_path / "PWNED"
    tally = fuzz(fuzz_bases, tmp_path, marker, count=1000, seed=21)
    assert tally.payloads == 0 and tally.tried == 1000
    assert tally.refused > 0 and tally.loaded > 0, tally.line()  # both outcomes are exercised
