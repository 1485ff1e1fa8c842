"""A program whose model class lives in ``__main__`` (a script), saved by one process and loaded by
another that cannot import the class: ``torch.save`` and ``dpcompile.export`` carry the programs
the calls need (eval mode, optional arguments left None, both values of a bool flag), DP and TP,
never the wrong program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SAVE = '''
import sys, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import dpcompile
warnings.filterwarnings("ignore")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8); self.drop = nn.Dropout(0.5); self.bn = nn.BatchNorm1d(8); self.head = nn.Linear(8, 4)

    def forward(self, x, mask=None, scale=None, return_hidden=False):
        h = self.bn(self.drop(F.relu(self.fc(x))))
        if self.training:
            h = h * 1.5
        if mask is not None:
            h = h * mask
        if scale is not None:
            h = h * scale
        out = self.head(h)
        return (out, h) if return_hidden else out

for out, kind in zip(sys.argv[1::2], sys.argv[2::2]):
    torch.manual_seed(0)
    model = Net()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=kind == "tp")
    x, mask, scale = torch.randn(6, 8), (torch.rand(6, 8) > 0.3).float(), torch.rand(6, 1)
    calls = [((x,), {}), ((x, mask), {}), ((x,), {"scale": scale}), ((x, mask, scale), {}),
             ((x,), {"return_hidden": True}), ((x[:1],), {})]
    model.eval()
    expected = [model(*args, **kwargs) for args, kwargs in calls]
    model.train()
    torch.save({"calls": calls, "expected": expected}, f"{out}/calls.pt")
    torch.save(pm, f"{out}/pm.pt")
    dpcompile.export(pm, f"{out}/folder")
'''

_LOAD = '''
import sys, traceback, torch, dpcompile
for out in sys.argv[1:]:
    data = torch.load(f"{out}/calls.pt")
    for how in ("pickle", "export"):
        try:
            pm = torch.load(f"{out}/pm.pt", weights_only=False) if how == "pickle" else dpcompile.load(f"{out}/folder")
            pm.eval()
            for (args, kwargs), want in zip(data["calls"], data["expected"]):
                got = pm(*args, **kwargs)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            print(out, "OK", how)
        except Exception:
            print(out, "FAILED", how, repr(traceback.format_exc()))
'''


def _run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=cwd, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


KINDS = ("dp", "tp")


@pytest.fixture(scope="module")
def loaded_lines(tmp_path_factory) -> dict[str, list[str]]:
    """Both kinds saved by one process (the class is its ``__main__.Net``) and loaded by another (one
    interpreter's start each for both kinds): each kind's output lines, ``OK <how>`` or ``FAILED ...``."""
    root = tmp_path_factory.mktemp("main_class")
    folders = {kind: root / kind for kind in KINDS}
    for folder in folders.values():
        folder.mkdir()
    _run(_SAVE, *(arg for kind, folder in folders.items() for arg in (str(folder), kind)), cwd=root)
    out = _run(_LOAD, *(str(folder) for folder in folders.values()), cwd=root)
    lines = {kind: [] for kind in KINDS}
    for line in out.splitlines():
        folder, _, rest = line.partition(" ")
        lines[Path(folder).name].append(rest)
    return lines


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.xdist_group("export_main_class")  # one save and one load process for both kinds, on one worker
def test_main_class_program_loads_with_eval_none_arguments_and_flags(loaded_lines, kind):
    """Saved where the class is __main__.Net, loaded elsewhere: eval mode, mask/scale left None or
    given, return_hidden=True and a small batch all match eager."""
    assert loaded_lines[kind] == ["OK pickle", "OK export"], loaded_lines[kind]
