"""``split_stages``: cut a single-device graph into pipeline stages, one per device.

:func:`find_stage_boundaries` chooses where the stages start: before the module paths the
user names (``pipeline=["layers.4", "layers.8"]``), or, for ``pipeline=N``, where the graph's
forward FLOPs (from the cost model, :func:`~dpcompile.analysis.split_fraction.node_flops`;
the parameter elements each op reads where no examples give shapes) divide into ``N`` equal
shares, preferring among near-equal cuts the one that sends the fewest values to the next
stage. :func:`split_stages` stamps every node with its stage (``node.meta["dpcompile_stage"]``);
the code does not change yet. Lowering (``insert_stage_transfers``) makes every value that
crosses a boundary an explicit ``send`` node.

Before::

    def forward(self, x):
        l0 = self.layers.0(x);  r0 = torch.relu(l0)
        l1 = self.layers.1(r0); r1 = torch.relu(l1)
        return r1

After ``split_stages`` with ``pipeline=2`` (the same code; stages as stamps, shown as comments)::

    def forward(self, x):
        l0 = self.layers.0(x);  r0 = torch.relu(l0)      # stage 0
        l1 = self.layers.1(r0); r1 = torch.relu(l1)      # stage 1
        return r1
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fx_utils import STAGE, unalias
from dpcompile.infra import PassResult

PASS = "split_stages"
BALANCE_TOLERANCE = 0.05  # a cut within 5% of a stage's share of the weight may move to send fewer values


@dataclass(frozen=True)
class StagePlan:
    """Where each stage starts and what it weighs.

    ``stage_of``: node name -> stage, for every node of the captured graph but placeholders and
    the output; ``starts``: the first node of each stage; ``weights``: forward FLOPs per stage
    (or parameter elements where ``measure`` says so); ``param_bytes``: bytes of the parameters
    and buffers each stage holds; ``module_paths``: the modules each stage calls or reads.
    """

    stages: int
    stage_of: Mapping[str, int]
    starts: tuple[str, ...]
    weights: tuple[int, ...]
    param_bytes: tuple[int, ...]
    module_paths: tuple[tuple[str, ...], ...]
    measure: str = "flops"
    sent: tuple[tuple[str, ...], ...] = field(default=())  # per boundary: the values stage s sends on

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the stages' weights (1.0: balanced)."""
        total = sum(self.weights)
        if total == 0:
            return 1.0
        return max(self.weights) / (total / len(self.weights))


def module_path_of(node: fx.Node) -> str | None:
    """The module a node belongs to: the one it calls, else the innermost one its code ran in."""
    if node.op == "call_module":  # the model's own name (a reserved first name is aliased: user:stages.0)
        return unalias(str(node.target))
    if node.op == "get_attr":
        return unalias(str(node.target)).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return path if isinstance(path, str) else None
    return None


def _in_module(path: str | None, prefix: str) -> bool:
    return path is not None and (path == prefix or path.startswith(prefix + "."))


def _body(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a stage can hold, in program order (``get_attr`` reads go with their first reader)."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _crossings(body: Sequence[fx.Node]) -> list[int]:
    """``out[i]``: how many values computed before ``body[i]`` are read at or after it."""
    index = {n: i for i, n in enumerate(body)}
    delta = [0] * (len(body) + 1)
    for i, node in enumerate(body):
        last = max((index[u] for u in node.users if u in index), default=i)
        if last > i:
            delta[i + 1] += 1
            delta[last + 1] -= 1
    out, running = [], 0
    for i in range(len(body)):
        running += delta[i]
        out.append(running)
    return out


def find_stage_boundaries(
    gm: fx.GraphModule,
    *,
    stages: int | Sequence[str],
    weights: Mapping[str, int] | None = None,
    no_cut_before: Collection[str] = (),
) -> StagePlan:
    """Where each stage of ``gm`` starts: before each module path of ``stages`` (a list), or
    ``stages`` (an int) stages of near-equal ``weights`` (node name -> forward FLOPs; by default
    the parameter elements each op reads), not before the nodes named in ``no_cut_before`` where
    another cut will do (inside a tensor-parallel region, whose values are sharded)."""
    from dpcompile.analysis.split_fraction import parameter_weights

    measure = "flops" if weights is not None else "parameter elements"
    weights = dict(weights if weights is not None else parameter_weights(gm))
    body = _body(gm)
    if isinstance(stages, int):
        if stages < 1:
            raise ArgumentError(f"pipeline={stages}: the number of stages must be at least 1")
        if stages > len(body):
            raise DpCompileError(
                f"pipeline={stages}: the graph has {len(body)} ops, too few to cut into {stages} stages"
            )
        allowed = [n.name not in no_cut_before for n in body]
        cuts = _balanced_cuts(body, [int(weights.get(n.name, 0)) for n in body], stages, allowed)
    else:
        cuts = _named_cuts(body, list(stages))
    return _plan(gm, body, cuts, weights, measure)


def _balanced_cuts(body: list[fx.Node], weight: list[int], stages: int, allowed: list[bool]) -> list[int]:
    """Indices of the first node of stages 1.. ``stages-1``: each within ``BALANCE_TOLERANCE`` of an
    equal share of the weight, the fewest values crossing it, then the nearest to the share."""
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    crossings = _crossings(body)
    cuts: list[int] = []
    for k in range(1, stages):
        low, high = (cuts[-1] + 1 if cuts else 1), len(body) - (stages - k)
        span = [i for i in range(low, high + 1) if allowed[i]] or list(range(low, high + 1))
        if total == 0:  # nothing weighs anything: equal node counts
            even = max(low, min(high, round(k * len(body) / stages)))
            cuts.append(min(span, key=lambda i: (abs(i - even), i)))
            continue
        ideal = k * total / stages
        nearest = min(span, key=lambda i: abs(prefix[i] - ideal))
        window = BALANCE_TOLERANCE * total / stages
        candidates = [i for i in span if abs(prefix[i] - ideal) <= window] or [nearest]
        # fewest values sent, then a cut before a module call that does work (an activation stays
        # with the layer it follows), then the nearest to an equal share
        cuts.append(
            min(
                candidates,
                key=lambda i: (crossings[i], not _starts_module(body, i), weight[i] == 0, abs(prefix[i] - ideal), i),
            )
        )
    return cuts


def _starts_module(body: Sequence[fx.Node], i: int) -> bool:
    """Whether ``body[i]`` is the first op of a module call (a cut there keeps modules whole)."""
    path = module_path_of(body[i])
    return body[i].op == "call_module" or (path is not None and path != module_path_of(body[i - 1]))


def _named_cuts(body: list[fx.Node], paths: list[str]) -> list[int]:
    if not paths:
        raise ArgumentError("pipeline=[]: name at least one module path where a stage starts, or pass pipeline=N")
    cuts: list[int] = []
    for path in paths:
        if not isinstance(path, str):
            raise ArgumentError(f"pipeline= module paths are strings as model.named_modules() spells them, got {path!r}")
        first = next((i for i, n in enumerate(body) if _in_module(module_path_of(n), path)), None)
        if first is None:
            known = sorted({p.rsplit(".", 1)[0] for n in body if (p := module_path_of(n))})[:12]
            raise ArgumentError(
                f"pipeline=: no op of the captured graph runs in module '{path}'; a stage starts before a module "
                f"forward calls, e.g. one of {known}"
            )
        if first == 0 or (cuts and first <= cuts[-1]):
            raise ArgumentError(
                f"pipeline={paths}: module '{path}' (op {first} of {len(body)}) does not start a new, non-empty stage; "
                "name module paths in the order forward calls them, after the first op"
            )
        cuts.append(first)
    return cuts


def _plan(
    gm: fx.GraphModule, body: list[fx.Node], cuts: list[int], weights: Mapping[str, int], measure: str
) -> StagePlan:
    bounds = [0, *cuts, len(body)]
    stage_of: dict[str, int] = {}
    for s in range(len(bounds) - 1):
        for node in body[bounds[s] : bounds[s + 1]]:
            stage_of[node.name] = s
    for node in gm.graph.nodes:  # a read of a parameter goes with its first reader
        if node.op == "get_attr":
            stage_of[node.name] = min((stage_of[u.name] for u in node.users if u.name in stage_of), default=0)
    n = len(bounds) - 1
    stage_weights = [0] * n
    for node in body:
        stage_weights[stage_of[node.name]] += int(weights.get(node.name, 0))
    param_bytes, paths = _state_per_stage(gm, stage_of, n)
    sent = []
    for s in range(n - 1):
        sent.append(tuple(
            node.name for node in body
            if stage_of[node.name] <= s and any(stage_of.get(u.name, n) > s for u in node.users)
        ))  # fmt: skip
    return StagePlan(
        stages=n,
        stage_of=stage_of,
        starts=tuple(body[b].name for b in bounds[:-1]),
        weights=tuple(stage_weights),
        param_bytes=tuple(param_bytes),
        module_paths=tuple(paths),
        measure=measure,
        sent=tuple(sent),
    )


def _state_per_stage(
    gm: fx.GraphModule, stage_of: Mapping[str, int], n: int
) -> tuple[list[int], list[tuple[str, ...]]]:
    """Bytes of the parameters and buffers each stage reads (a tensor counted in its first stage),
    and the modules each stage calls or reads."""
    modules = dict(gm.named_modules())
    seen: set[int] = set()
    sizes = [0] * n
    paths: list[list[str]] = [[] for _ in range(n)]
    for node in gm.graph.nodes:
        if node.name not in stage_of or node.op not in ("call_module", "get_attr"):
            continue
        s = stage_of[node.name]
        if node.op == "call_module":
            module = modules.get(node.target)
            tensors = [] if module is None else [*module.parameters(), *module.buffers()]
            path = str(node.target)
        else:
            value = _attribute(gm, str(node.target))
            tensors = (
                [value]
                if isinstance(value, torch.Tensor)
                else [*value.parameters(), *value.buffers()]
                if isinstance(value, nn.Module)
                else []
            )
            path = str(node.target).rpartition(".")[0] if isinstance(value, torch.Tensor) else str(node.target)
        if path and path not in paths[s]:
            paths[s].append(path)
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                sizes[s] += t.numel() * t.element_size()
    return sizes, [tuple(p) for p in paths]


def _attribute(root: nn.Module, path: str) -> object:
    value: object = root
    for atom in path.split("."):
        value = getattr(value, atom)
    return value


def split_stages(gm: fx.GraphModule, *, plan: StagePlan) -> PassResult:
    """Stamp every node of ``gm`` with its stage (``node.meta["dpcompile_stage"]``) as ``plan`` says.
    The code is unchanged; ``insert_stage_transfers`` lowers the stages to devices."""
    for node in gm.graph.nodes:
        if node.name in plan.stage_of:
            node.meta[STAGE] = plan.stage_of[node.name]
    return PassResult(gm, False, {"plan": plan})


def follow_plan(gm: fx.GraphModule, plan: StagePlan) -> StagePlan:
    """``plan`` carried over to another trace of the same model (the other mode, an argument left
    None): a node keeps the stage of the node of the same name, else its predecessor's, so each
    module stays on the device it was placed on."""
    body = _body(gm)
    cuts: list[int] = []
    current = 0
    for i, node in enumerate(body):
        stage = plan.stage_of.get(node.name, current)
        while stage > current and len(cuts) < plan.stages - 1:
            cuts.append(i)
            current += 1
    while len(cuts) < plan.stages - 1:  # a stage the other trace leaves empty still has its device
        cuts.append(len(body) - (plan.stages - 1 - len(cuts)))
    return _plan(gm, body, cuts, {}, plan.measure)


def stage_programs(gm: fx.GraphModule, plan: StagePlan, devices: Sequence[str]) -> list[fx.GraphModule]:
    """One program per stage, for one micro-batch: its inputs are what it receives (the model's
    inputs it reads, the values earlier stages send it), its outputs what later stages or the
    model's output read; a value sent on is a ``send`` to the next stage's device.

    For ``pipeline=2`` on an MLP, stage 1::

        def forward(self, relu_1):
            layers_2 = getattr(self.layers, "2")(relu_1)
            relu_2 = torch.relu(layers_2)
            return (relu_2,)
    """
    from dpcompile import runtime
    from dpcompile.fx_utils import graph_module

    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    programs = []
    for s in range(plan.stages):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        mine = [n for n in nodes if plan.stage_of.get(n.name) == s]

        def read(value: fx.Node, graph: fx.Graph = graph, env: dict = env) -> fx.Node:
            if value not in env:
                env[value] = graph.placeholder(value.name)
            return env[value]

        for node in mine:
            for value in node.all_input_nodes:
                if plan.stage_of.get(value.name) != s:
                    read(value)
        for node in mine:
            env[node] = graph.node_copy(node, lambda v, env=env: env[v])
        sends = []
        for node in mine:
            later = {plan.stage_of.get(u.name) for u in node.users if u.op != "output"} - {s}
            if later:
                t = min(later)
                sends.append(
                    graph.create_node(
                        "call_function", runtime.send, (env[node], devices[t]), name=f"{node.name}_to_stage{t}"
                    )
                )
            elif node in output.all_input_nodes:
                sends.append(env[node])
        graph.output(tuple(sends))
        programs.append(graph_module(gm, graph, f"Stage{s}"))
    return programs
