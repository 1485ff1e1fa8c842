"""Shared checks: a transformed model against an untouched copy of itself, run eagerly."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

import dpcompile
from dpcompile.capture import capture
from dpcompile.fx_utils import propagate_shapes
from dpcompile.modules.executors import executor_of
from dpcompile.runtime.structures import tensor_leaves
from dpcompile.runtime.tensor_parallel import unshard


def scalar_of(output: Any) -> torch.Tensor:
    """A deterministic scalar of every floating tensor in ``output``, for backward."""
    total = torch.zeros(())
    for i, (_, t) in enumerate(tensor_leaves(output)):
        if t.is_floating_point() and t.requires_grad:
            weights = torch.linspace(0.5, 1.5, t.numel(), dtype=t.dtype).view(t.shape)
            total = total + (t * weights).sum() * (i + 1)
    return total


def assert_weighted_gradients_equal(
    model: nn.Module, eager: nn.Module, out: torch.Tensor, expected: torch.Tensor
) -> None:
    """Backward ``sum(out * w)`` and ``sum(expected * w)`` (``w`` a fixed ramp, so every element
    counts differently) and compare every parameter gradient of ``model`` with ``eager``'s by name."""
    weights = torch.linspace(0.5, 1.5, out.numel()).view(out.shape)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    grads = dict(eager.named_parameters())
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[key].grad, msg=lambda m, key=key: f"{key}: {m}")


def assert_same_outputs(got: Any, want: Any, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert type(got) is type(want), f"{type(got).__name__} != {type(want).__name__}"
    got_leaves, want_leaves = tensor_leaves(got), tensor_leaves(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, f"{path}: {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m, p=path: f"{p}: {m}")


def check_against_eager(
    make_model: Callable[[], nn.Module],
    devices: Any,
    *args: Any,
    atol: float = 1e-5,
    backward: bool = True,
    **kwargs: Any,
) -> dpcompile.ParallelModule:
    """Transform a model and check outputs and parameter gradients against its eager twin."""
    model = make_model()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, devices, **kwargs.pop("transform_kwargs", {}))
    got = pm(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    want = reference(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    assert_same_outputs(got, want, atol=atol, rtol=atol)
    if backward:
        scalar_of(got).backward()
        scalar_of(want).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.abs().sum(), name
                continue
            assert p.grad is not None, f"no gradient reached {name}"
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=atol, msg=lambda m, n=name: f"grad {n}: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, atol=atol, rtol=atol, msg=lambda m, n=name: f"buffer {n}: {m}")
    return pm


def to_fake_cuda(model: nn.Module, mode: Any) -> nn.Module:
    """Replace ``model``'s tensors by fake ones on ``cuda:0`` (works on a CPU-only build).

    Parameters cannot be created on fake CUDA directly (their init kernels need CUDA), so
    they are made on the CPU and converted.
    """
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = mode.from_tensor(p.detach())
                with mode:
                    module._parameters[name] = nn.Parameter(fake.to("cuda:0"), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                fake = mode.from_tensor(b)
                with mode:
                    module._buffers[name] = fake.to("cuda:0")
        if isinstance(module, nn.RNNBase):
            module._flat_weights = [module._parameters.get(n) for n in module._flat_weights_names]
    return model


def captured(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """A captured copy of ``model``; with ``inputs``, its nodes carry shapes (``meta["val"]``)."""
    gm = capture(copy.deepcopy(model))
    if inputs:
        assert propagate_shapes(gm, list(inputs))
    return gm


def targets(gm: fx.GraphModule) -> list[str]:
    """The names of the functions ``gm`` calls, in order."""
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


class FakeMesh:
    """Enough of a DeviceMesh for a pass, which only records it (groups are looked up lazily)."""

    ndim = 1
    mesh_dim_names = ("tp",)
    device_type = "cpu"


def full_gradients(pm: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradient of every parameter under the model's name: shards gathered, the rest as they are;
    None for a sharded parameter no shard of which got a gradient (frozen, or detached), as eager's."""
    out: dict[str, torch.Tensor | None] = {}
    for key, (spec, names) in pm.param_shards.items():
        shards = [pm.get_parameter(n) for n in names]
        if all(s.grad is None for s in shards):
            out[key] = None
            continue
        out[key] = unshard([torch.zeros_like(s) if s.grad is None else s.grad for s in shards], spec, "cpu")
    sharded = {n for _, names in pm.param_shards.values() for n in names}
    out.update({name: p.grad for name, p in pm.named_parameters() if name not in sharded})
    return out


def model_gradients(model: nn.Module) -> Callable[[], dict[str, torch.Tensor | None]]:
    """``model``'s gradients by name, read when called (a program sharing the model's parameters)."""
    return lambda: {name: p.grad for name, p in model.named_parameters()}


def assert_lm_step_equals_eager(
    pm: Callable[..., Any],
    eager: nn.Module,
    inputs: dict[str, Any],
    gradients: Callable[[], dict[str, torch.Tensor | None]],
    **tolerance: float,
) -> None:
    """One call of a model with ``labels=`` (float64): ``logits`` and ``loss`` equal eager's; then the
    loss plus a weighted sum of the logits backpropagated through both, and every one of eager's
    parameter gradients equals ``gradients()``'s under its name (``tolerance``: ``atol``, ``rtol``)."""
    got, want = pm(**inputs), eager(**inputs)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    weights = torch.linspace(0.5, 1.5, want.logits.numel(), dtype=torch.float64).view(want.logits.shape)
    (got.loss + (got.logits * weights).sum()).backward()
    (want.loss + (want.logits * weights).sum()).backward()
    ours = gradients()
    for name, p in eager.named_parameters():
        assert ours.get(name) is not None, f"no gradient reached {name}"
        torch.testing.assert_close(ours[name], p.grad, **tolerance, msg=lambda m, name=name: f"grad {name}: {m}")


# the virtual device counts the context-parallel model tests run on, each with its lengths: one that
# divides it and one that does not (on 4: 7 tokens, shards of 2, 2, 2 and a short last one of 1)
CONTEXT_PARALLEL_LENGTHS = {2: (12, 13), 4: (8, 7)}


def context_parallel_copies(
    built: nn.Module, inputs: Callable[[int], dict[str, Any]]
) -> Iterator[tuple[int, tuple[int, ...], Any, nn.Module, nn.Module]]:
    """For each count of :data:`CONTEXT_PARALLEL_LENGTHS`: ``(n, lengths, pm, model, eager)``, where
    ``model`` and ``eager`` are fresh copies of ``built`` (built once) and ``pm`` is ``model``
    transformed with ``mesh={"cp": n}`` by the export frontend, examples ``inputs(lengths[0])``."""
    for n, lengths in CONTEXT_PARALLEL_LENGTHS.items():
        model, eager = copy.deepcopy(built), copy.deepcopy(built)
        pm = dpcompile.transform(
            model, ["cpu"] * n, mesh={"cp": n}, example_kwargs=inputs(lengths[0]), frontend="export"
        )
        yield n, lengths, pm, model, eager


def assert_runs_split_like_eager(cls: type[nn.Module], shape: tuple[int, ...], frontend: str) -> None:
    """``cls()`` on 3 devices (examples of 4 rows, called with 5: uneven chunks): forward and
    every gradient equal eager, nothing runs whole, every FLOP runs split."""
    torch.manual_seed(0)
    model = cls()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 3, frontend=frontend, example_inputs=(torch.randn(4, *shape),))
    x = torch.randn(5, *shape)
    out, expected = pm(x), eager(x)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(model, eager, out, expected)
    report = dpcompile.explain(pm, x)
    assert report.whole == []
    assert report.split_flop_fraction == 1.0


def assert_cp_rank_lm_step_equals_eager(pm: nn.Module, model: nn.Module, eager: nn.Module, whole: dict[str, Any],
                                        mesh: Any) -> None:  # fmt: skip
    """One call of a ``("cp",)`` rank program on this rank's tokens of ``whole`` against ``eager`` on
    all of them: the rank's logits, the loss, and every gradient of the loss plus a weighted sum of
    the logits (the program scales them so DDP's average is the sum); gradients zeroed after."""
    import torch.distributed as dist

    from dpcompile.mesh import local_batch

    seq = whole["input_ids"].shape[1]
    mine = torch.tensor_split(torch.arange(seq), dist.get_world_size())[dist.get_rank()]
    got, want = pm(**local_batch(whole, mesh)), eager(**whole)
    torch.testing.assert_close(got.logits, want.logits[:, mine])
    torch.testing.assert_close(got.loss, want.loss)
    weights = torch.linspace(0.5, 1.5, want.logits.numel(), dtype=torch.float64).view(want.logits.shape)
    (got.loss + (got.logits * weights[:, mine]).sum()).backward()
    (want.loss + (want.logits * weights).sum()).backward()
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, name=name: f"seq {seq}, grad {name}: {m}")
    model.zero_grad()
    eager.zero_grad()


def assert_square_sum_step_equals_eager(model: nn.Module, eager: nn.Module, got: torch.Tensor,
                                        want: torch.Tensor) -> None:  # fmt: skip
    """``got`` equals ``want``; after backward of each one's ``square().sum()``, every parameter
    gradient of ``model`` equals ``eager``'s (in parameter order)."""
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def assert_steps_equal_eager(
    pm: Callable[..., Any],
    eager: nn.Module,
    inputs: Callable[[int], tuple],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    loss: Callable[[torch.Tensor], torch.Tensor] = torch.square,
    steps: int = 2,
) -> None:
    """``steps`` optimizer steps of ``pm`` and ``eager`` on ``inputs(step)``: each step's output, then
    every gradient after backward of ``loss(output).sum()`` (shards gathered), and the state after
    the last step equal eager's."""
    opt, eager_opt = optimizer(pm.parameters()), optimizer(eager.parameters())
    for step in range(steps):
        got, want = pm(*inputs(step)), eager(*inputs(step))
        torch.testing.assert_close(got, want, msg=lambda m, step=step: f"output of step {step}: {m}")
        loss(got).sum().backward()
        loss(want).sum().backward()
        grads = full_gradients(pm) if getattr(pm, "param_shards", None) else {n: p.grad for n, p in pm.named_parameters()}
        for name, p in eager.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name, step=step: f"grad {name}, step {step}: {m}")
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
    state = pm.state_dict()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key} after {steps} steps: {m}")


def assert_stage_is_a_parallel_module(pm: nn.Module) -> None:
    """A pipeline's stage over a mesh is a ``dpcompile.ParallelModule`` (a ``torch.fx.GraphModule``) whose
    graph and code are this rank's stage program, the one its schedule runs: it names the modules this stage holds;
    ``eval()``/``train()`` reach that program's modules and the whole program's."""
    assert isinstance(pm, dpcompile.ParallelModule) and isinstance(pm, fx.GraphModule), type(pm).__mro__
    assert pm.executor == "pipelining" and executor_of(pm).runs_one_stage_per_rank
    code = pm.code
    assert isinstance(code, str) and code.strip().startswith("def forward(self"), code
    names = {path.replace(".", "_") for path in pm.module_paths}
    assert all(name in code for name in names), (sorted(names), code)
    assert [n.name for n in pm.graph.nodes] == [n.name for n in pm.program.graph.nodes], code
    assert pm.eval() is pm and not any(m.training for m in (pm, pm.program, *pm.program.modules(), pm.whole))
    assert pm.train() is pm and all(m.training for m in (pm, pm.program, *pm.program.modules(), pm.whole))


def assert_whole_state_loads(pm: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """``pm.load_state_dict`` of whole tensors in the model's keys (each rank keeps its pieces) gives
    them back from ``pm.state_dict()`` (a collective); a load missing a key is refused and changes nothing."""
    shifted = {key: value + 1 if value.is_floating_point() else value for key, value in expected.items()}
    first = next(iter(shifted))
    try:
        pm.load_state_dict({k: v for k, v in shifted.items() if k != first})
    except RuntimeError as e:
        assert f"missing keys ['{first}']" in str(e) and "nothing was loaded" in str(e), e
    else:
        raise AssertionError("a load missing a key was not refused")
    unchanged = pm.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(unchanged[key], value, msg=lambda m, key=key: f"{key} after a refused load: {m}")
    pm.load_state_dict(shifted)
    loaded = pm.state_dict()
    assert list(loaded) == list(shifted)
    for key, value in shifted.items():
        torch.testing.assert_close(loaded[key], value, msg=lambda m, key=key: f"{key} loaded: {m}")
    pm.load_state_dict(expected)


def assert_mesh_pipeline_verifies(pm: nn.Module, model: nn.Module, *args: Any, **kwargs: Any) -> dpcompile.VerifyResult:
    """verify of a pipeline over a mesh, the same inputs (the whole batch) on every rank: OK, the same
    text on every rank; then a weight of another stage corrupted in this rank's copy of the model
    (eager's alone: pm holds its stage's): a gradient mismatch, the same text on every rank."""
    import torch.distributed as dist

    def same_on_every_rank(text: str) -> None:
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, text)
        assert len(set(seen)) == 1, seen

    result = dpcompile.verify(pm, model, *args, **kwargs)
    assert result.ok and result.checked["parameter gradients"] > 0 and result.checked["outputs"], result
    same_on_every_rank(str(result))
    mine = tuple(pm.module_paths)
    name, p = next((n, p) for n, p in model.named_parameters()
                   if not any(n == m or n.startswith(m + ".") for m in mine))  # fmt: skip
    saved = p.detach().clone()
    with torch.no_grad():
        p.add_(0.5)
    try:
        corrupted = dpcompile.verify(pm, model, *args, **kwargs)
    finally:
        with torch.no_grad():
            p.copy_(saved)
    assert not corrupted.ok and any(m.kind == "gradient" for m in corrupted.mismatches), (name, str(corrupted))
    same_on_every_rank(str(corrupted))
    return result
