"""Layouts named by ``mesh=`` over a device list: the arithmetic checked once, the same programs as
the older keywords, ``pm.layout`` / ``pm.strategies``, and no keyword silently ignored."""

import math
import re

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from dpcompile.devices import Devices
from dpcompile.target import Target, dp_copies, resolve_target
from tests.helpers import full_gradients


class Stack(nn.Module):
    def __init__(self, width=8, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
                                    for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.sum(dim=-1).mean()


def _train_step(module, params, x):
    loss = module(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_layout_of_the_older_keywords():
    """pm.layout and pm.strategies spell what the keywords built."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 2)
    assert pm.layout == {"dp": 2} and pm.strategies == {"dp": "data parallel (replicate)"}
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, tensor_parallel=True)
    assert pm.layout == {"tp": 2} and pm.strategies == {"tp": "tensor parallel"}


@pytest.mark.parametrize(
    "mesh, strategy",
    [({"dp": 2}, "data_parallel"), ({"tp": 2}, "tensor_parallel"), ({"dp": 2, "tp": 2}, "tensor_parallel"),
     ({"pp": 2, "dp": 2}, "pipeline"), ({"pp": 1, "dp": 2}, "data_parallel")],
)
def test_layout_strategy_is_one_of_the_three_api_names_by_what_the_layout_does(mesh, strategy):
    """pm.strategy is "data_parallel", "tensor_parallel" or "pipeline" (API.md): dp x tp shards layers,
    so "tensor_parallel" (it said "pipeline", the one stage it is built as, with no pp in the layout)."""
    n = 1
    for size in mesh.values():
        n *= size
    pm = dpcompile.transform(Stack(depth=2), ["cpu"] * n, mesh=mesh)
    assert pm.strategy == strategy


@pytest.mark.parametrize("mesh, strategy", [({"dp": 2, "tp": 2}, "tensor_parallel"), ({"pp": 1, "dp": 2}, "data_parallel"),
                                            ({"pp": 2, "dp": 2}, "pipeline")])  # fmt: skip
def test_layout_strategy_of_a_loaded_program_is_its_recipes(tmp_path, mesh, strategy):
    """An exported program's strategy is what its recipe built, not read off its layout (main read the
    kind's name there: a loaded dp x tp said "pipeline"); a folder written without a layout loads too."""
    pm = dpcompile.transform(Stack(depth=2), ["cpu"] * math.prod(mesh.values()), mesh=mesh)
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "out"))
    assert loaded.layout == pm.layout
    assert pm.strategy == loaded.strategy == strategy
    del loaded.__dict__["layout"]
    assert loaded.strategy == strategy


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}, {"tp": 2, "pp": 2}],
                         ids=["dp_tp", "pp_dp", "pp_dp_tp", "tp_pp"])  # fmt: skip
def test_layout_of_a_loaded_program_checks_on_fake_devices(tmp_path, mesh):
    """A loaded program keeps its layout (``program.json``'s ``config.layout``), so
    ``verify(fake_devices=)`` places its dp copies as the original's (main: the pp x dp programs failed
    with "no attribute 'layout'", and a dp-only export loaded on 3 devices is a 3-copy layout)."""
    torch.manual_seed(0)
    model, x = Stack(depth=2), torch.randn(8, 8)
    n = math.prod(mesh.values())
    loaded = dpcompile.load(dpcompile.export(dpcompile.transform(model, ["cpu"] * n, mesh=mesh), tmp_path / "out"))
    assert loaded.layout == mesh
    result = dpcompile.verify(loaded, model, x, fake_devices=n)
    assert result.ok, str(result)
    dp = dpcompile.load(dpcompile.export(dpcompile.transform(model, ["cpu"] * 2), tmp_path / "dp"), devices=["cpu"] * 3)
    assert dp.layout == {"dp": 3}


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"pp": 2, "tp": 2}, {"tp": 2, "pp": 2}])
def test_layout_mesh_trains_like_eager(mesh):
    """Every layout built in one process, named by mesh=: loss and gradients equal eager."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(6, 8)
    reference = Stack()
    reference.load_state_dict(model.state_dict())
    n = 1
    for size in mesh.values():
        n *= size
    pm = dpcompile.transform(model, ["cpu"] * n, mesh=mesh)
    assert pm.layout == mesh
    loss, grads = _train_step(pm, list(pm.parameters()), x)
    ref_loss, _ = _train_step(reference, list(reference.parameters()), x)
    torch.testing.assert_close(loss, ref_loss)
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key])
    named = dict(pm.named_parameters())
    if mesh == {"dp": 2} or mesh == {"pp": 2}:  # shares the model's parameters: gradients by the model's names
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[key])
    else:
        assert named and all(p.grad is not None for p in named.values())
    del grads


def test_layout_mesh_tp_outermost_lays_out_devices_as_written():
    """{"tp": 2, "pp": 2}: stage 0 holds devices 0 and 2 (tp outermost), reordered stage-major."""
    target = resolve_target(["cpu:0", "cpu:1", "cpu:2", "cpu:3"], {"tp": 2, "pp": 2}, pipeline=None,
                            tensor_parallel=False)
    assert [str(d) for d in target.canonical_devices()] == ["cpu:0", "cpu:2", "cpu:1", "cpu:3"]
    target = Target((("pp", 2), ("tp", 2)), Devices(tuple(torch.device(f"cpu:{k}") for k in range(4))))
    assert [d.index for d in target.canonical_devices()] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("mesh", "n", "match"),
    [
        ({"pp": 2, "tp": 2}, 6, r"pp\(2\) x tp\(2\) = 4 devices, but 6 were given"),
        ({"xp": 2}, 2, "not one of"),
        ({"dp": 0}, 2, "positive ints"),
        ({"dp": True}, 1, "positive ints"),
        ({}, 2, "dict of dimension sizes"),
    ],
)
def test_layout_mesh_arithmetic_is_checked_with_the_numbers(mesh, n, match):
    """A mesh that does not fit the devices is refused with its arithmetic."""
    with pytest.raises(ValueError, match=match):
        dpcompile.transform(Stack(), ["cpu"] * n, mesh=mesh)


@pytest.mark.parametrize("mesh", [{"pp": 2, "dp": 2, "cp": 2}, {"dp": 2, "pp": 2, "cp": 2, "tp": 2}])
def test_layout_not_built_names_the_nearest(mesh):
    """A layout not built in one process is a DpCompileError that names one that works (for cp:
    cp alone, with dp or tp or both beside it, or with pp)."""
    n = 1
    for size in mesh.values():
        n *= size
    with pytest.raises(DpCompileError, match=r"is not built in one process yet; use mesh=\{'cp': N\} in one process, .*\{'dp': D, 'cp': N, 'tp': T\}\), or with 'pp' \(\{'pp': S, 'cp': N\} or \{'pp': S, 'cp': N, 'tp': T\}"):
        dpcompile.transform(Stack(), ["cpu"] * n, mesh=mesh)


@pytest.mark.parametrize(
    ("mesh", "options", "names"),
    [
        ({"dp": 2, "tp": 2}, {}, {"_dp0", "_dp1"}),
        ({"pp": 2, "dp": 2}, {}, {"_dp0", "_dp1"}),
        ({"pp": 2, "dp": 2}, {"micro_batches": 2}, {"_dp0_mb0", "_dp0_mb1", "_dp1_mb0", "_dp1_mb1"}),
        ({"dp": 2, "pp": 2, "tp": 2}, {}, {"_dp0", "_dp1"}),
    ],
)
def test_layout_dp_composed_trains_like_eager_and_names_each_copy(mesh, options, names):
    """dp over a pipeline or tensor-parallel program: eager's loss and gradients, each copy named in
    pm.code, and load_state_dict in the model's keys."""
    torch.manual_seed(0)
    model, reference = Stack(), Stack()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(6, 8)
    n = 1
    for size in mesh.values():
        n *= size
    pm = dpcompile.transform(model, ["cpu"] * n, mesh=mesh, **options)
    loss = pm(x)
    loss.backward()
    ref_loss = reference(x)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    grads = full_gradients(pm) if getattr(pm, "param_shards", None) else {k: p.grad for k, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key: f"gradient of {key}: {m}")
    assert set(re.findall(r"_dp\d+(?:_mb\d+)?(?=\b|_)", pm.code)) == names
    assert pm.layout == mesh and pm.strategies["dp"] == "data parallel (replicate)"
    other = Stack()  # load_state_dict takes the model's keys and whole tensors, and the program follows
    pm.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pm(x), other(x))


def test_layout_dp_composed_explain_names_each_dimension():
    """explain names every dimension, and counts a pipeline's micro-batches in each dp copy."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 8, mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=2)
    report = dpcompile.explain(pm, torch.randn(8, 8))
    assert report.layout == {"pp": "2: pipeline (gpipe)", "dp": "2: data parallel (replicate)", "tp": "2: tensor parallel"}
    assert report.pipeline["micro_batches"] == 2 and report.pipeline["dp_copies"] == 2
    assert "Layout: pp(2: pipeline (gpipe)); dp(2: data parallel (replicate)); tp(2: tensor parallel)" in str(report)
    assert "2 micro-batches in each of 2 dp copies" in str(report)


def test_layout_dp_composed_over_distinct_devices_places_each_copy():
    """dp copies of a pipeline on distinct devices: copy r on the devices of dp index r (more in
    tests/test_layouts_dp_copies.py)."""
    target = resolve_target(["cpu:0", "cpu:1", "cpu:2", "cpu:3"], {"pp": 2, "dp": 2}, pipeline=None,
                            tensor_parallel=False)
    assert [[str(d) for d in copy] for copy in dp_copies(target)] == [["cpu:0", "cpu:2"], ["cpu:1", "cpu:3"]]
    pm = dpcompile.transform(Stack(), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], mesh={"pp": 2, "dp": 2})
    assert pm.recipe.dp_devices == (("cpu:0", "cpu:2"), ("cpu:1", "cpu:3"))
    assert [str(d) for d in pm.devices] == ["cpu:0", "cpu:2"]


def test_layout_dp_composed_memory_per_device_needs_examples():
    """memory_per_device= with dp copies predicts from a fake run: without examples, refused by name."""
    with pytest.raises(ValueError, match=r"memory_per_device= with the layout \{'dp': 2, 'tp': 2\} predicts"):
        dpcompile.transform(Stack(), ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, memory_per_device="1GiB")


def test_layout_mesh_disagreeing_keywords_are_refused():
    """pipeline= / tensor_parallel= that contradict mesh= are refused, not overridden."""
    with pytest.raises(ValueError, match="makes 3 stages but mesh= has 'pp': 2"):
        dpcompile.transform(Stack(), ["cpu"] * 2, mesh={"pp": 2}, pipeline=3)
    with pytest.raises(ValueError, match="has none"):
        dpcompile.transform(Stack(), ["cpu"] * 2, mesh={"dp": 2}, tensor_parallel=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batches": 4}, "feeds a pipeline"),
        ({"schedule": "1f1b"}, "orders a pipeline"),
        ({"ddp_options": {"bucket_cap_mb": 1}}, "over a DeviceMesh"),
        ({"copy_replicas": True, "tensor_parallel": True}, "copy_replicas=True"),
        ({"sequence_parallel": True, "tensor_parallel": True, "pipeline": 2, "schedule": "1f1b"},
         "sequence_parallel=True with schedule='1f1b' is not built"),
        ({"sequence_parallel": True, "tensor_parallel": True}, "pass example_inputs="),
        ({"activation_checkpointing": "every"}, "activation_checkpointing="),
        ({"activation_checkpointing": "auto"}, "memory_per_device="),
        ({"plan": "auto"}, "example_inputs="),  # without a budget it plans for the devices' own memory
        ({"exact_random": "yes"}, "exact_random="),
        ({"pipeline": "layers.1"}, r"pipeline='layers.1': expected a number of stages, or a list of module paths"),
        ({"copy_replicas": "yes"}, "copy_replicas='yes': expected True or False"),
        ({"training": "no"}, "training='no': expected True or False"),
        ({"optimizer": "adam9"}, "optimizer='adam9'"),
        ({"dynamic_dims": "1"}, r"dynamic_dims='1': expected \{argument name"),
        ({"dynamic_dims": [-1]}, "non-negative dims"),
        ({"dynamic_dims": [1.0]}, "non-negative dims"),
        ({"dynamic_dims": [True]}, "non-negative dims"),
        ({"dynamic_dims": [5], "example_inputs": (torch.randn(2, 8),)}, r"names dim\(s\) \[5\], which no tensor argument"),
    ],
)
def test_layout_keyword_never_silently_ignored(kwargs, match):
    """A keyword the layout would not read is refused by name."""
    with pytest.raises((ValueError, DpCompileError), match=match):
        dpcompile.transform(Stack(), ["cpu"] * 2, **kwargs)


def test_layout_exact_random_true_is_accepted():
    """exact_random=True (the default, spelled) builds a program that draws the single-device values."""
    pm = dpcompile.transform(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), ["cpu"] * 2, exact_random=True)
    assert "exact_dropout" in pm.code


def test_layout_exact_random_false_is_todays_draw():
    """exact_random=False (per-device draws) is honoured: the program builds and runs."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, exact_random=False)
    assert pm(torch.randn(4, 8)).shape == ()


def test_layout_data_parallel_replicate_is_the_default_spelled():
    """data_parallel="replicate" is the default data parallelism."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, data_parallel="replicate")
    assert pm.strategies == {"dp": "data parallel (replicate)"}


def _unjoined_mesh(shape, names):
    """A DeviceMesh that joins no process group: enough to check arguments against."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).view(*shape), mesh_dim_names=names,
                      _init_backend=False, _rank=0)


@pytest.mark.parametrize(
    ("kwargs", "shape", "names", "match"),
    [
        ({"pipeline": 2, "ddp_options": {"bucket_cap_mb": 1}, "data_parallel": "fsdp"}, (2, 2), ("pp", "dp"),
         'ddp_options= configures DistributedDataParallel, and data_parallel="fsdp" runs FSDP2 instead'),
        ({"ddp_options": {"bucket_cap_mb": 1}, "data_parallel": "fsdp"}, (4,), ("dp",),
         'ddp_options= configures DistributedDataParallel, and data_parallel="fsdp" runs FSDP2 instead'),
        ({"pipeline": 2, "ddp_options": {"bucket_cap_mb": 1}}, (2,), ("pp",),
         r"ddp_options= configures DistributedDataParallel over the mesh's data-parallel dimension, and the layout \{'pp': 2\} has none"),
        ({"pipeline": 2, "tensor_parallel": True, "ddp_options": {"bucket_cap_mb": 1}}, (2, 2), ("pp", "tp"),
         "data-parallel dimension, and the layout .* has none"),
        ({"tensor_parallel": True, "ddp_options": {"bucket_cap_mb": 1}}, (4,), ("tp",),
         "data-parallel dimension, and the layout .* has none"),
        ({"pipeline": 2, "ddp_options": {"bucket_cap": 1}}, (2, 2), ("pp", "dp"),
         r"ddp_options= names \['bucket_cap'\], which DistributedDataParallel does not take"),
        ({"ddp_options": {"process_group": None}}, (4,), ("dp",), r"names \['process_group'\].*sets module, process_group"),
        ({"pipeline": 2, "ddp_options": {"static_graph": True}}, (2, 2), ("pp", "dp"),
         r"ddp_options=\{'static_graph': True\} with pipeline= over a DeviceMesh"),
        ({"output_device": "cpu"}, (2, 2), ("pp", "dp"), "output_device="),
        ({"ddp_options": {"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": None}}, (2,), ("dp",),
         r"\['delay_all_reduce_named_params', 'param_to_hook_all_reduce'\]: DDP's delayed all-reduce is not supported"),
    ],
)
def test_layout_mesh_pipeline_keywords_refused_not_dropped(kwargs, shape, names, match):
    """Over a DeviceMesh, DDP options where nothing runs DDP (FSDP instead, or no 'dp' dimension: a
    ('pp',), ('pp', 'tp') or ('tp',) mesh) are refused by name, where main dropped them (or, with a
    pipeline, refused them all), and so is a name DDP does not take or dpcompile sets (main: a
    TypeError from DDP, or the user's process_group replacing the mesh's); so is output_device=. With a pipeline over a ('pp', 'dp') mesh DDP
    options are honoured (tests/integration/test_pipeline_mesh.py's ddp_options)."""
    from dpcompile.keywords import check_keywords_honoured

    with pytest.raises((ValueError, DpCompileError), match=match):
        check_keywords_honoured(_unjoined_mesh(shape, names), **kwargs)
    check_keywords_honoured(_unjoined_mesh((2, 2), ("pp", "dp")), pipeline=2, ddp_options={"bucket_cap_mb": 1})
    check_keywords_honoured(_unjoined_mesh((2, 2, 2), ("pp", "dp", "tp")), pipeline=2, tensor_parallel=True,
                            ddp_options={"bucket_cap_mb": 1})  # fmt: skip


def test_layout_sequence_parallel_over_a_mesh_tp_and_dp():
    """sequence_parallel=True over a ('tp',) or ('dp', 'tp') DeviceMesh passes the keyword check (built:
    tests/integration/test_sequence_parallel_mesh.py, test_spmd.py's 4 processes); with a 'pp' dimension
    it is refused by name."""
    from dpcompile.keywords import check_keywords_honoured

    check_keywords_honoured(_unjoined_mesh((2,), ("tp",)), tensor_parallel=True, sequence_parallel=True)
    check_keywords_honoured(_unjoined_mesh((2, 2), ("dp", "tp")), tensor_parallel=True, sequence_parallel=True)
    for shape, names in (((2, 2), ("pp", "tp")), ((2, 2, 2), ("pp", "dp", "tp"))):
        with pytest.raises(DpCompileError, match="sequence_parallel=True with pp over a DeviceMesh is not built"):
            check_keywords_honoured(_unjoined_mesh(shape, names), tensor_parallel=True, sequence_parallel=True)


@pytest.mark.parametrize("names", [("pp", "dp"), ("dp", "tp")])
def test_layout_exact_random_true_over_a_mesh_is_honoured(names):
    """exact_random=True over a DeviceMesh (with or without 'pp') passes the keyword check: every rank
    draws the single-device values (tests/integration/test_exact_random_mesh.py runs it)."""
    from dpcompile.keywords import check_keywords_honoured

    check_keywords_honoured(_unjoined_mesh((2, 2), names), exact_random=True, tensor_parallel="tp" in names)


def test_layout_three_dimensional_mesh_and_fsdp_pipeline_accepted():
    """A ('pp', 'dp', 'tp') DeviceMesh and FSDP with a pipeline pass the keyword checks (built:
    tests/integration/test_pipeline_mesh_compose.py); a ('cp',) or ('dp', 'cp') mesh passes too (built:
    tests/integration/test_context_parallel_mesh.py), and a ('cp', 'tp') one (test_context_parallel_mesh_dp.py);
    'cp' beside 'pp', or with 'dp' and 'tp', is refused by name."""
    from dpcompile.keywords import check_keywords_honoured
    from dpcompile.target import mesh_layout

    check_keywords_honoured(_unjoined_mesh((2, 2, 2), ("pp", "dp", "tp")), pipeline=2, tensor_parallel=True)
    check_keywords_honoured(_unjoined_mesh((2, 2, 2), ("pp", "dp", "tp")), pipeline=2, data_parallel="fsdp")
    check_keywords_honoured(_unjoined_mesh((2, 2), ("pp", "dp")), pipeline=2, data_parallel="fsdp")
    check_keywords_honoured(_unjoined_mesh((2,), ("cp",)))
    assert mesh_layout(_unjoined_mesh((2,), ("cp",)), pipeline=None, tensor_parallel=False) == {"cp": 2}
    check_keywords_honoured(_unjoined_mesh((2, 2), ("dp", "cp")))
    with pytest.raises(DpCompileError, match=r"context parallel\) is not built over a DeviceMesh yet: .*torch.distributed"
                       r".pipelining.*Use a \('pp',\) DeviceMesh .*, a \('cp',\) or \('cp', 'tp'\) one .*mesh=\{'pp': S, 'cp': N\}"):
        check_keywords_honoured(_unjoined_mesh((2, 2), ("pp", "cp")), pipeline=2)
    with pytest.raises(DpCompileError, match=r"tensor parallel\) is not built over a DeviceMesh yet: .*Use a \('cp', 'tp'\) "
                       r"DeviceMesh \(without 'dp'\), a \('dp', 'cp'\) one \(without 'tp'\), or mesh=\{'dp': D, 'cp': N, 'tp': T\}"):
        check_keywords_honoured(_unjoined_mesh((2, 2, 2), ("dp", "cp", "tp")), tensor_parallel=True)
    check_keywords_honoured(_unjoined_mesh((2, 2), ("cp", "tp")), tensor_parallel=True)


def test_layout_survives_pickling():
    """torch.save / torch.load keep pm.layout and pm.strategies."""
    import io

    pm = dpcompile.transform(Stack(), ["cpu"] * 2, tensor_parallel=True)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert copy.layout == {"tp": 2} and copy.strategies == {"tp": "tensor parallel"}
