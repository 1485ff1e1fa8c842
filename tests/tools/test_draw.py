"""draw and its graphviz source, to_dot."""

from __future__ import annotations

import shutil

import pytest

import dpcompile
from dpcompile.inspect import to_dot
from tests.models import MLP, BNNet


def _dp(model, n: int = 2) -> dpcompile.ParallelModule:
    return dpcompile.transform(model, ["cpu"] * n)


def test_draw_writes_svg_with_one_cluster_per_device(tmp_path):
    """With graphviz: an SVG holding one cluster per device and the collectives in red."""
    if shutil.which("dot") is None:
        pytest.skip("graphviz 'dot' is not installed")
    path = dpcompile.draw(_dp(BNNet()), tmp_path / "graph.svg")
    text = path.read_text()
    assert path.suffix == ".svg" and "<svg" in text
    assert "cluster_0" in text and "cluster_1" in text
    assert "cpu#0" in text and "cpu#1" in text and "bn_sync" in text
    assert "#e41a1c" in text


def test_to_dot_highlights_collectives_outside_clusters():
    """The dot source clusters per-device nodes and styles communication nodes apart."""
    source = to_dot(_dp(BNNet()))
    cluster_1 = source.split("subgraph cluster_1")[1].split("}")[0]
    assert '"fc_dev1"' in cluster_1 and '"bn_sync"' not in cluster_1
    assert 'color="#e41a1c"' in source.split('"bn_sync" [')[1].split("];")[0]


def test_draw_falls_back_to_matplotlib_png_without_dot(tmp_path, monkeypatch):
    """Without dot, draw writes a PNG through matplotlib."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr("dpcompile.inspect.pictures.shutil.which", lambda name: None)
    path = dpcompile.draw(_dp(BNNet()), tmp_path / "graph.svg")
    assert path == tmp_path / "graph.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_without_any_renderer_says_what_to_install(tmp_path, monkeypatch):
    """Neither dot nor matplotlib: a DpCompileError naming both ways out."""
    monkeypatch.setattr("dpcompile.inspect.pictures.shutil.which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(dpcompile.DpCompileError, match="graphviz.*matplotlib"):
        dpcompile.draw(_dp(MLP()), tmp_path / "graph.svg")

