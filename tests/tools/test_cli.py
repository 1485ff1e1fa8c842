"""The dpcompile command line: demo, inspect, export, help and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

import dpcompile
from dpcompile.cli import main

FACTORY_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return x


    def make():
        return Net(), (torch.randn(6, 8),)


    def make_plain():
        return Net()


    def make_branchy():
        return Branchy()
    """
)


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(FACTORY_FILE)
    return path


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_cli_demo_prints_code_table_and_verification(capsys):
    """`dpcompile demo` shows the generated code, the explain table and a passing verify."""
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "def forward(self, x" in out and "dpcompile_runtime_scatter" in out
    assert "Per device" in out and "Communication" in out
    assert "verify: OK" in out


def test_cli_help_works_for_every_command(capsys):
    """--help exits 0 and shows the usage of the tool and of each command."""
    for argv in (["--help"], ["demo", "--help"], ["inspect", "--help"], ["export", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert "usage: dpcompile" in capsys.readouterr().out


def test_cli_console_script_is_installed():
    """The `dpcompile` console script runs and prints its help."""
    exe = shutil.which("dpcompile")
    if exe is None:
        pytest.skip("the console script is not on PATH (package not installed)")
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "inspect" in done.stdout and "export" in done.stdout


def test_python_dash_m_dpcompile_is_the_command(monkeypatch, capsys):
    """``python -m dpcompile --help`` runs the same command (run in this process, as -m runs it)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["dpcompile", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("dpcompile", run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0 and "inspect" in out and "export" in out


def test_cli_inspect_prints_code_and_explain_table(factory, capsys):
    """inspect FILE:FACTORY --devices 2 prints pm.code and the explain table with shapes."""
    assert main(["inspect", f"{factory}:make", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "x_scatter = dpcompile_runtime_scatter" in out
    assert "shapes from fake tensors" in out and "3x16" in out


def test_cli_inspect_without_example_inputs_says_how_to_get_shapes(factory, capsys):
    """A factory returning only the model still works, and the output says how to add shapes."""
    assert main(["inspect", f"{factory}:make_plain", "--devices", "2"]) == 0
    assert "return (model, example_inputs)" in capsys.readouterr().out


def test_cli_inspect_json_is_machine_readable(factory, capsys):
    """--json prints one JSON document holding the code and the report."""
    assert main(["inspect", f"{factory}:make", "--devices", "cpu,cpu,cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "def forward" in data["code"]
    assert set(data["report"]["param_bytes"]) == {"cpu#0", "cpu#1", "cpu#2"}


def test_cli_inspect_draws_a_picture(factory, tmp_path, capsys):
    """--draw writes the picture (SVG with dot, else PNG) and says where."""
    if shutil.which("dot") is None:
        pytest.importorskip("matplotlib")
    target = tmp_path / "graph.svg"
    assert main(["inspect", f"{factory}:make", "--devices", "2", "--draw", str(target)]) == 0
    out = capsys.readouterr().out
    written = target if target.exists() else target.with_suffix(".png")
    assert written.exists() and f"picture written to {written}" in out


def test_cli_inspect_tensor_parallel_shows_the_plan(factory, capsys):
    """--tensor-parallel transforms with the automatic plan and prints it."""
    code = main(["inspect", f"{factory}:make", "--devices", "2", "--tensor-parallel"])
    out = capsys.readouterr()
    if code != 0 and "not available" in out.err:
        pytest.skip("tensor parallelism not available yet")
    assert code == 0, out.err
    assert "Tensor-parallel plan" in out.out and "fc1" in out.out


def test_cli_export_writes_a_loadable_folder(factory, tmp_path, capsys):
    """export -o DIR writes the folder, which dpcompile.load reads back."""
    target = tmp_path / "exported"
    assert main(["export", f"{factory}:make", "--devices", "2", "-o", str(target)]) == 0
    assert "runs no code from the folder" in capsys.readouterr().out
    loaded = dpcompile.load(target)
    assert loaded.mode == "data_parallel" and len(loaded.devices) == 2


def test_cli_missing_file_is_one_line_and_exit_1(tmp_path, capsys):
    """A FILE that does not exist: exit 1 and one line naming it."""
    assert main(["inspect", f"{tmp_path}/nope.py:make", "--devices", "2"]) == 1
    line = _one_line_error(capsys)
    assert line.startswith("dpcompile: error: no such file") and "nope.py" in line


def test_cli_missing_factory_is_one_line_listing_what_exists(factory, capsys):
    """A FACTORY the file lacks: exit 1, one line listing the callables it has."""
    assert main(["export", f"{factory}:build", "--devices", "2", "-o", "unused"]) == 1
    line = _one_line_error(capsys)
    assert "no callable 'build'" in line and "make" in line


def test_cli_untraceable_model_is_one_line_naming_the_source(factory, capsys):
    """A model that branches on data: exit 1, one line with the file:line of the branch."""
    assert main(["inspect", f"{factory}:make_branchy", "--devices", "2"]) == 1
    line = _one_line_error(capsys)
    assert "models.py:" in line and "x.sum() > 0" in line


def test_cli_debug_shows_the_traceback(factory):
    """With --debug the error propagates with its traceback."""
    with pytest.raises(dpcompile.TraceError):
        main(["inspect", f"{factory}:make_branchy", "--devices", "2", "--debug"])


def test_cli_debug_before_the_command_shows_the_traceback(factory):
    """`dpcompile --debug inspect ...` (the top-level flag) propagates the error too."""
    with pytest.raises(dpcompile.TraceError):
        main(["--debug", "inspect", f"{factory}:make_branchy", "--devices", "2"])


def test_cli_bad_target_syntax_is_one_line(capsys):
    """A target without ':FACTORY' says what the form is."""
    assert main(["inspect", "model.py", "--devices", "2"]) == 1
    assert "FILE.py:FACTORY" in _one_line_error(capsys)


def test_cli_without_command_prints_help_and_exits_2(capsys):
    """`dpcompile` alone prints the help and exits 2."""
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out

