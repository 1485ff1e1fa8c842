"""benchmarks/gpu_check.py: skips cleanly without CUDA; its sections run on virtual CPU devices."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_gpu_check_skips_without_cuda(tmp_path, capsys):
    """Without CUDA it exits 0, says why, and writes JSON marked skipped."""
    out = tmp_path / "gpu_check.json"
    assert _load().main(["--out", str(out)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["skipped"] is True and "no CUDA" in result["reason"]


def test_gpu_check_sections_run_on_virtual_cpu_devices(tmp_path):
    """--cpu-smoke runs every section (small sizes) and every check holds."""
    out = tmp_path / "smoke.json"
    assert _load().main(["--cpu-smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    sections = {"dp_training_step", "rnn", "tp_forward", "explain_fake_8gpu", "exact_random"}
    assert result["failed"] == [] and set(result["sections"]) == sections
    exact = result["sections"]["exact_random"]
    assert set(exact["checks"]) == {"mlp_float32_dp", "gpt_sdpa_float32_tp", "gpt_sdpa_float32_gpipe"}, exact
    assert all(exact[key]["generator_equal"] for key in exact["checks"])
    assert result["sections"]["rnn"]["default"]["chunk_warnings"] == 0
