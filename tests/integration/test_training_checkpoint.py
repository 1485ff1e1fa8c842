"""Training checkpoints across layouts in one process: a small LM (fused qkv, 3 heads, an LM head tied
to the embedding; float64) trained one AdamW step under one layout, saved with its optimizer,
scheduler, RNG and ``extra``, and loaded under every other layout and device count: parameters
and AdamW state bit-identical to what was saved, the next 2 steps' losses and parameters equal an
uninterrupted eager run. Then what a load refuses (and leaves untouched), and a save killed midway."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import CheckpointError

LAYOUTS = {"dp3": {"dp": 3}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "pp2xtp2": {"pp": 2, "tp": 2}}
#: data_parallel="fsdp" in one process (test_training_checkpoint_fsdp_one_process.py): 3 copies (uneven pieces)
FSDP_LAYOUTS = {"fsdp3": {"dp": 3}, "fsdp2xtp2": {"dp": 2, "tp": 2}, "pp2xfsdp2": {"pp": 2, "dp": 2}}
V, D, HEADS = 32, 12, 3
ROOT = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        # fused, sharded by sections (whole heads of q, k and v); no bias: the k bias has no gradient
        # (softmax ignores it), and AdamW moves such an element by ~lr whatever the rounding
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied: vocab-parallel under tensor parallelism

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)) for _ in range(3)]


def make_model():
    torch.manual_seed(0)
    return TinyLM().double()


def build(layout: dict[str, int], data_parallel: str = "ddp"):
    """``(program, AdamW, StepLR)`` of a fresh model under ``layout`` (virtual CPU devices; distinct
    ones, cpu:0.., for pipeline x tensor parallel, so the head tied across its stages is sent)."""
    n = 1
    for size in layout.values():
        n *= size
    devices = [f"cpu:{i}" for i in range(n)] if layout.keys() == {"pp", "tp"} else ["cpu"] * n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(make_model(), devices, mesh=layout, example_inputs=batches()[0],
                                 data_parallel=data_parallel)  # fmt: skip
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    return pm, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def train_step(pm, opt, sched, batch) -> float:
    loss = pm(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.item()


def state_in_model_layout(pm, opt, name: str) -> dict[str, torch.Tensor]:
    """The optimizer's ``name`` state of every parameter, as the model's full tensors: written into
    the program's parameters for a moment and read back through ``pm.state_dict()`` (the program's
    own unsharding, not the checkpoint code's)."""
    params = list(pm.parameters())
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(opt.state[p][name])
        out = {k: v.clone() for k, v in pm.state_dict().items()}
        for p, k in zip(params, kept):
            p.copy_(k)
    return out


def eager_run():
    """Losses of 3 AdamW steps of the eager model, and its parameters after them."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = [train_step(model, opt, sched, b) for b in batches()]
    return losses, model.state_dict()


_PROGRAMS: dict[str, tuple] = {}
_SAVED: dict[str, dict] = {}


def program(name: str):
    """One program per layout for the whole module (building is most of a test's time), set back to
    the model's initial weights, with a fresh AdamW and StepLR."""
    if name not in _PROGRAMS:
        _PROGRAMS[name] = build({**LAYOUTS, **FSDP_LAYOUTS}[name], "fsdp" if name in FSDP_LAYOUTS else "ddp")[0]
    pm = _PROGRAMS[name]
    pm.load_state_dict(make_model().state_dict())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    return pm, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def saved(name: str, folder: Path) -> dict:
    """Layout ``name`` trained one step and saved under ``folder``: what it held when saved."""
    if name not in _SAVED:
        pm, opt, sched = program(name)
        train_step(pm, opt, sched, batches()[0])
        rng = torch.get_rng_state()
        dpcompile.save_checkpoint(pm, folder / name, optimizer=opt, lr_scheduler=sched, extra={"step": 1, "from": name})
        _SAVED[name] = {
            "path": folder / name,
            "params": {k: v.clone() for k, v in pm.state_dict().items()},
            "exp_avg": state_in_model_layout(pm, opt, "exp_avg"),
            "exp_avg_sq": state_in_model_layout(pm, opt, "exp_avg_sq"),
            "step": float(next(iter(opt.state.values()))["step"]),
            "lr": opt.param_groups[0]["lr"],
            "rng": rng,
        }
    return _SAVED[name]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("training_checkpoints")


@pytest.fixture(scope="module")
def eager():
    return eager_run()


PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


@pytest.mark.parametrize(("source", "dest"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_saved_under_one_layout_resumes_under_another(source, dest, folder, eager):
    """Parameters and AdamW state bit-identical after the load; the next 2 steps equal eager's."""
    before = saved(source, folder)
    pm = program(dest)[0]
    opt = torch.optim.AdamW(pm.parameters(), lr=1.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    torch.manual_seed(123)  # the load restores the RNG the save saw
    dpcompile.load_checkpoint(pm, before["path"], optimizer=opt, lr_scheduler=sched)

    assert torch.equal(torch.get_rng_state(), before["rng"])
    assert pm.checkpoint_extra == {"step": 1, "from": source}
    for key, value in pm.state_dict().items():
        assert torch.equal(value, before["params"][key]), key
    for name in ("exp_avg", "exp_avg_sq"):
        for key, value in state_in_model_layout(pm, opt, name).items():
            assert torch.equal(value, before[name][key]), (name, key)
    assert all(float(s["step"]) == before["step"] for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == before["lr"] and opt.param_groups[0]["weight_decay"] == 0.1
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)

    losses, params = eager
    resumed = [train_step(pm, opt, sched, b) for b in batches()[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, params[key], rtol=1e-10, atol=1e-12, msg=key)


def test_sgd_momentum_and_sharded_optimizer_files(tmp_path):
    """SGD's momentum_buffer from tensor parallel into data parallel, the optimizer state in
    several files with their index; a one-file save after it removes the stale shards."""
    pm = program("tp2")[0]
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    for batch in batches()[:2]:
        pm(*batch).backward()
        opt.step()
        opt.zero_grad()
    dpcompile.save_checkpoint(pm, tmp_path, optimizer=opt, max_shard_size="4KB")
    names = sorted(p.name for p in tmp_path.iterdir())
    shards = [n for n in names if n.startswith("optimizer-")]
    assert "optimizer.safetensors.index.json" in names and len(shards) > 1, names
    assert not any(n.endswith(".tmp") for n in names)

    dp = program("dp3")[0]
    dp_opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    dpcompile.load_checkpoint(dp, tmp_path, optimizer=dp_opt)
    expected = state_in_model_layout(pm, opt, "momentum_buffer")
    for key, value in state_in_model_layout(dp, dp_opt, "momentum_buffer").items():
        assert torch.equal(value, expected[key]), key

    dpcompile.save_checkpoint(dp, tmp_path, optimizer=dp_opt)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.startswith("optimizer")] == ["optimizer.safetensors"], names


def _snapshot(pm, opt):
    return copy.deepcopy(pm.state_dict()), copy.deepcopy(opt.state_dict())


def _assert_unchanged(pm, opt, snapshot):
    params, state = snapshot
    for key, value in pm.state_dict().items():
        assert torch.equal(value, params[key]), key
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"]
    assert now["state"].keys() == state["state"].keys()
    for index, values in state["state"].items():
        for name, value in values.items():
            assert torch.equal(now["state"][index][name], value), (index, name)


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    """A checkpoint saved under tensor parallelism after one AdamW step."""
    path = tmp_path_factory.mktemp("tp_checkpoint")
    pm, opt, sched = program("tp2")
    train_step(pm, opt, sched, batches()[0])
    dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched)
    return path


def _edited(checkpoint: Path, to: Path, edit) -> Path:
    """A copy of ``checkpoint`` whose optimizer tensors ``edit`` changed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    to.mkdir()
    for file in checkpoint.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    tensors = load_file(to / "optimizer.safetensors")
    with safe_open(str(to / "optimizer.safetensors"), framework="pt") as f:
        metadata = f.metadata()  # the save's token: still the same save
    edit(tensors)
    save_file(tensors, to / "optimizer.safetensors", metadata=metadata)
    return to


def _trained_pp():
    pm, opt, sched = program("pp2")
    train_step(pm, opt, sched, batches()[2])  # some other state, to see that a refused load keeps it
    return pm, opt, sched


def test_refused_loads_name_the_fault_and_change_nothing(tp_checkpoint, tmp_path):
    pm, opt, sched = _trained_pp()
    snapshot = _snapshot(pm, opt)

    sgd = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"AdamW.*SGD|SGD.*AdamW"):
        dpcompile.load_checkpoint(pm, tp_checkpoint, optimizer=sgd)

    embed = [p for n, p in pm.named_parameters() if "embed" in n]
    rest = [p for n, p in pm.named_parameters() if "embed" not in n]
    grouped = torch.optim.AdamW([{"params": rest}, {"params": embed, "weight_decay": 0.0}], lr=1e-2)
    with pytest.raises(CheckpointError, match="param group"):
        dpcompile.load_checkpoint(pm, tp_checkpoint, optimizer=grouped)

    part = torch.optim.AdamW(rest, lr=1e-2)
    with pytest.raises(CheckpointError, match=r"saved but not here \['embed.weight'\].*strict=False"):
        dpcompile.load_checkpoint(pm, tp_checkpoint, optimizer=part)

    plain = tmp_path / "plain"
    dpcompile.save_checkpoint(pm, plain)  # weights only
    with pytest.raises(CheckpointError, match="saved without optimizer"):
        dpcompile.load_checkpoint(pm, plain, optimizer=opt)

    def drop(tensors):
        del tensors["optimizer.state.blocks.0.fc.weight.exp_avg"]

    with pytest.raises(CheckpointError, match=r"checkpoint \S*lacking\S* lacks 'optimizer.state.blocks.0.fc.weight.exp_avg'"):
        dpcompile.load_checkpoint(
            pm, _edited(tp_checkpoint, tmp_path / "lacking", drop), optimizer=opt, lr_scheduler=sched
        )
    malformed = _edited(tp_checkpoint, tmp_path / "malformed", lambda tensors: None)
    document = json.loads((malformed / "training_state.json").read_text())
    document["optimizer"]["groups"] = 5
    (malformed / "training_state.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match="optimizer entry is malformed"):
        dpcompile.load_checkpoint(pm, malformed, optimizer=opt)
    _assert_unchanged(pm, opt, snapshot)
    assert sched.last_epoch == 1

    dpcompile.load_checkpoint(pm, tp_checkpoint, optimizer=part, strict=False)  # the state of what it holds
    assert len(part.state) == len(rest) and all(float(s["step"]) == 1.0 for s in part.state.values())


def _drop_a_state_kind(doc):  # a state entry listed no more (its tensor still in optimizer.safetensors)
    del doc["optimizer"]["state"]["blocks.0.fc.weight"]["step"]


def _hyper(name, value):
    def edit(doc):
        doc["optimizer"]["groups"][0]["hyper"][name] = value

    return edit


def _scheduler(name, value):
    def edit(doc):
        doc["lr_scheduler"]["state"][name] = value

    return edit


TRAINING_STATE_EDITS = {
    "state_kind_dropped": (_drop_a_state_kind, "does not list"),  # was a KeyError after the optimizer was set
    "lr_nan": (_hyper("lr", float("nan")), "of another kind .*'lr'"),  # loaded: the next step made NaN weights
    "maximize_a_string": (_hyper("maximize", "x"), "of another kind .*'maximize'"),
    "betas_one_number": (_hyper("betas", [0.9]), "of another kind .*'betas'"),
    "hyper_unknown_not_a_scalar": (_hyper("momentum_x", {"a": 1}), r"unknown \['momentum_x'\]"),
    "scheduler_key_unknown": (_scheduler("optimizer", 1), r"does not hold \['optimizer'\]"),  # replaced its optimizer
    "scheduler_value_a_string": (_scheduler("last_epoch", "x"), r"another kind \['last_epoch'\]"),
    # these loaded: AdamW's constructor refuses them, load_state_dict does not (the next step used them)
    "eps_negative": (_hyper("eps", -1.0), "refused by AdamW itself .Invalid epsilon value: -1.0"),
    "betas_out_of_range": (_hyper("betas", [1.5, 0.999]), "refused by AdamW itself .Invalid beta parameter at index 0"),
    "lr_negative": (_hyper("lr", -0.01), "refused by AdamW itself .Invalid learning rate"),
    # an int JSON holds that no float can (the first step raised OverflowError)
    "lr_too_large_for_a_float": (_hyper("lr", 10**400), "of another kind .*'lr'"),
    "scheduler_value_too_large": (_scheduler("last_epoch", 10**400), r"another kind \['last_epoch'\]"),
    "extra_not_a_dict": (lambda doc: doc.__setitem__("extra", [1]), "its extra entry is a list"),  # was pm.checkpoint_extra
}


@pytest.mark.parametrize("edit", TRAINING_STATE_EDITS)
def test_an_edited_training_state_is_refused_before_anything_is_set(edit, tp_checkpoint, tmp_path):
    """training_state.json edited so that the optimizer or scheduler would take a state that breaks it
    (or silently another one): a CheckpointError naming the checkpoint, the program, optimizer and
    scheduler as they were (the weights too: they are written after every check)."""
    change, match = TRAINING_STATE_EDITS[edit]
    pm, opt, sched = _trained_pp()
    snapshot, schedule = _snapshot(pm, opt), str(sched.state_dict())
    folder = _edited(tp_checkpoint, tmp_path / "edited", lambda tensors: None)
    document = json.loads((folder / "training_state.json").read_text())
    change(document)
    (folder / "training_state.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=match) as error:
        dpcompile.load_checkpoint(pm, folder, optimizer=opt, lr_scheduler=sched)
    assert str(folder) in str(error.value)
    _assert_unchanged(pm, opt, snapshot)
    assert str(sched.state_dict()) == schedule and not hasattr(sched, "optimizer_x")


def test_an_optimizer_with_a_scheduler_loads_a_state_saved_without_one(tmp_path):
    """The scheduler added ``initial_lr`` to the loading optimizer's groups, the saved groups lack it:
    the hyper-parameter check lets that key be, as ``optimizer.load_state_dict`` does."""
    pm, _, _ = program("tp2")
    plain = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)  # no scheduler: no initial_lr
    pm(*batches()[0]).backward()
    plain.step()
    dpcompile.save_checkpoint(pm, tmp_path, optimizer=plain)
    saved = _snapshot(pm, plain)
    pm, opt, sched = program("tp2")
    dpcompile.load_checkpoint(pm, tmp_path, optimizer=opt)
    _assert_unchanged(pm, opt, saved)


def test_a_shape_that_differs_is_named(tp_checkpoint, tmp_path):
    """A state tensor whose shape is not its parameter's: the key, both shapes; nothing loaded."""
    pm, opt, sched = _trained_pp()
    snapshot = _snapshot(pm, opt)

    def widen(tensors):
        tensors["optimizer.state.blocks.1.proj.weight.exp_avg"] = torch.zeros(D, D + 1, dtype=torch.float64)

    broken = _edited(tp_checkpoint, tmp_path / "wider", widen)
    with pytest.raises(CheckpointError, match=r"blocks.1.proj.weight.exp_avg' is \[12, 13\].*\[12, 12\]"):
        dpcompile.load_checkpoint(pm, broken, optimizer=opt)
    _assert_unchanged(pm, opt, snapshot)


def test_bad_save_arguments_write_nothing(tmp_path):
    pm, opt, _ = program("dp3")
    with pytest.raises(ValueError, match="JSON-able"):
        dpcompile.save_checkpoint(pm, tmp_path / "a", optimizer=opt, extra={"when": object()})
    with pytest.raises(ValueError, match="folder"):
        dpcompile.save_checkpoint(pm, tmp_path / "b.safetensors", optimizer=opt)
    with pytest.raises(ValueError, match="format='safetensors'"):
        dpcompile.save_checkpoint(pm, tmp_path / "c", format="zip")
    foreign = torch.optim.AdamW(make_model().parameters())  # the model's tensors, not the program's
    with pytest.raises(CheckpointError, match="not a parameter of this program"):
        dpcompile.save_checkpoint(pm, tmp_path / "d", optimizer=foreign)
    assert list(tmp_path.iterdir()) == []


KILLED_SAVE = """
import sys, time, torch
sys.path.insert(0, {root!r})
import dpcompile
from dpcompile.checkpoint import save, training
from tests.integration.test_training_checkpoint import LAYOUTS, batches, build, train_step

pm, opt, sched = build(LAYOUTS["dp3"])
train_step(pm, opt, sched, batches()[0])
dpcompile.save_checkpoint(pm, {path!r}, optimizer=opt, lr_scheduler=sched, extra={{"step": 1}})
torch.save({{k: v for k, v in pm.state_dict().items()}}, {expected!r})
print("SAVED", flush=True)
train_step(pm, opt, sched, batches()[1])

real = save.write_safetensors
def write_slowly(path, entries, make, *args, **kwargs):
    def made(key):
        if key == entries[len(entries) // 2][0]:  # half of the first file written: wait to be killed
            print("WRITING", flush=True)
            time.sleep(600)
        return make(key)
    return real(path, entries, made, *args, **kwargs)
save.write_safetensors = training.write_safetensors = write_slowly
dpcompile.save_checkpoint(pm, {path!r}, optimizer=opt, lr_scheduler=sched, extra={{"step": 2}})
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.endswith(".tmp")}


@pytest.mark.slow  # a fresh process: torch's import and a build, about 10 s
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    """A process saving over a checkpoint is SIGKILLed (from here) halfway through a file: the
    previous checkpoint's files are byte for byte as they were, and it loads whole."""
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    script = KILLED_SAVE.format(root=str(ROOT), path=str(path), expected=str(expected))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "SAVED", child.stderr.read()[-2000:] if child.poll() else ""
        before = _files(path)
        assert child.stdout.readline().strip() == "WRITING", child.stderr.read()[-2000:] if child.poll() else ""
        staged = [p for p in path.iterdir() if p.name.endswith(".tmp")]
        assert staged  # the second save is writing its first file
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert _files(path) == before  # nothing of the killed save renamed into place, nothing removed

    pm, opt, sched = program("pp2xtp2")
    dpcompile.load_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched)
    assert pm.checkpoint_extra == {"step": 1}
    params = torch.load(expected)
    for key, value in pm.state_dict().items():
        assert torch.equal(value, params[key]), key
    assert all(float(s["step"]) == 1.0 for s in opt.state.values())

    live = path / f".model.safetensors.{os.getpid()}-0123abcd.tmp"  # a save still running in this process
    live.write_bytes(b"")
    dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched)  # the next save clears the dead one's
    assert [p.name for p in path.iterdir() if p.name.endswith(".tmp")] == [live.name]
    dpcompile.load_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched)


@pytest.mark.parametrize(
    ("shape", "dim", "sizes", "sections"),
    [
        ((7, 4), 0, (4, 3), 1),
        ((5, 6), 1, (2, 4), 1),
        ((18, 4), 0, (12, 6), 3),
        ((2, 3, 9), 2, (6, 3), 3),
        ((8,), 0, (5, 3), 1),
    ],
)
def test_shard_runs_are_the_whole_tensors_bytes(shape, dim, sizes, sections, monkeypatch):
    """A sharded tensor is written as runs of its shards, never put together: the runs' bytes are
    the whole tensor's, in order (row, column and fused-qkv shards, uneven too; rows in blocks)."""
    from dpcompile.checkpoint import runs, targets
    from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of

    whole = torch.randn(shape, dtype=torch.float64)
    spec = ShardSpec(dim, sizes, sections=sections)
    shards = [shard_of(whole, spec, k) for k in range(len(sizes))]
    largest = max(s.numel() * s.element_size() for s in shards)
    for run_bytes in (runs.STAGING_BYTES, 1, 100):  # the largest shard's bytes, a row at a time, a few rows
        monkeypatch.setattr(runs, "STAGING_BYTES", run_bytes)
        parts = [r.clone() for r in targets.shard_runs(shards, spec)]  # each valid until the next is made
        assert all(r.numel() * r.element_size() <= largest for r in parts), run_bytes
        assert torch.equal(torch.cat([r.reshape(-1) for r in parts]), whole.reshape(-1)), run_bytes


def test_a_folder_mixing_two_saves_is_refused(tp_checkpoint, tmp_path):
    """Weights of another save copied over a training checkpoint's (what a crash among the final
    renames leaves): the files' save token differs from training_state.json's; nothing loaded."""
    pm, opt, sched = _trained_pp()
    snapshot = _snapshot(pm, opt)
    other = tmp_path / "other"
    dpcompile.save_checkpoint(pm, other, optimizer=opt)
    mixed = _edited(tp_checkpoint, tmp_path / "mixed", lambda tensors: None)
    (mixed / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="model.safetensors is not from the save.*mixes two saves"):
        dpcompile.load_checkpoint(pm, mixed, optimizer=opt, lr_scheduler=sched)
    (mixed / "model.safetensors").write_bytes((tp_checkpoint / "model.safetensors").read_bytes())
    (mixed / "optimizer.safetensors").write_bytes((other / "optimizer.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="optimizer.safetensors is not from the save"):
        dpcompile.load_checkpoint(pm, mixed, optimizer=opt)
    _assert_unchanged(pm, opt, snapshot)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_loaded_optimizer_state_is_memory_of_its_own(tp_checkpoint):
    """Each state tensor is read into memory of its own: none stays a view of a checkpoint file's
    mapping (its bytes would be read at the first step, and the file held open)."""
    pm, opt, _ = program("pp2xtp2")
    dpcompile.load_checkpoint(pm, tp_checkpoint, optimizer=opt)
    assert len(opt.state) == len(list(pm.parameters()))
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(tp_checkpoint) in line]
    assert mapped == [], mapped[:3]
