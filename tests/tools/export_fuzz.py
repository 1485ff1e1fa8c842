"""Random mutations of real ``program.json`` files, loaded as an attacker would leave them.

Each mutation edits one exported program (call targets, method names, attribute paths,
arguments, module classes, nesting, whole nodes, views with explicit strides), regenerates
``module.py`` with dpcompile's own code where it still decodes (one time in eight it leaves the
old one), rehashes the manifest and calls ``dpcompile.load``. The only outcomes allowed:
``ExportError``, or a module that runs (any exception a computation may raise is fine) and
returns values; a folder whose ``module.py`` is not the one its program regenerates never
loads, nor one nested past the bound; and a marker file, whose path every payload carries,
never appears.
Used by ``tests/tools/test_export_fuzz.py`` (bounded) and ``benchmarks/export_fuzz.py`` (more).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import dpcompile
from dpcompile.export import ExportError
from dpcompile.export.build import readable_programs
from dpcompile.export.integrity import MAX_NESTING
from dpcompile.export.source import program_source
from dpcompile.export.vocabulary import TENSOR_METHODS, vocabulary
from tests.tools.export_attacks import rehash, write_program

DANGEROUS_TARGETS = [
    "os.system", "builtins.eval", "builtins.exec", "builtins.open", "builtins.__import__", "subprocess.call",
    "torch.save", "torch.load", "torch.from_file", "torch.ops.aten.from_file.default", "torch.ops.aten.save.default",
    "dpcompile.runtime.exported.aten_op", "builtins.getattr", "builtins.max", "builtins.min", "operator.attrgetter",
    "operator.methodcaller", "torch.Tensor.numpy", "torch.Tensor.tofile", "torch.Tensor.untyped_storage",
    "torch.Tensor.data_ptr", "torch.Tensor.apply_", "torch.Tensor.register_hook", "torch.hub.load",
    "pickle.loads", "torch.ops.aten.__class__.default", "math.__loader__", "dpcompile.runtime.refresh_replicas",
]  # fmt: skip
DANGEROUS_METHODS = ["numpy", "tofile", "__class__", "__reduce_ex__", "data_ptr", "untyped_storage", "apply_",
                     "register_hook", "storage", "set_", "tolist", "__init__", "__globals__", "save", "load"]  # fmt: skip
DANGEROUS_PATHS = ["__class__", "forward.__globals__", "__dict__", "_modules", "0.__class__", "training", "numpy"]
DANGEROUS_CLASSES = ["os._wrap_close", "subprocess.Popen", "builtins.object", "transformers.pytorch_utils.Conv1D",
                     "torch.nn.modules.module.Module", "dpcompile.runtime.replicate.ReplicaRoot", "plain", None, 3]  # fmt: skip
STRIDED_TARGETS = ["torch.as_strided", "torch.Tensor.as_strided", "torch.ops.aten.as_strided.default",
                   "torch.as_strided_copy", "torch.ops.aten.as_strided_.default", "torch.Tensor.as_strided_"]  # fmt: skip
GETATTR_NAMES = ["numpy", "tofile", "shape", "dtype", "training", "__class__", "forward", "weight", "T", "_modules"]


@dataclasses.dataclass
class Base:
    """An exported program to mutate: its folder, program.json, and a call that runs it."""

    name: str
    folder: Path
    program: dict[str, Any]
    run: Callable[[torch.nn.Module], Any]
    weight: int = 1  # mutations of this program per round (a large program loads slowly)


@dataclasses.dataclass
class Tally:
    tried: int = 0
    refused: int = 0
    loaded: int = 0
    ran: int = 0  # loaded and returned values
    raised: int = 0  # loaded, and the call raised (a computation error)
    payloads: int = 0
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        return (
            f"mutations tried {self.tried}, refused {self.refused}, loaded {self.loaded} "
            f"(ran {self.ran}, raised {self.raised}); payloads run: {self.payloads}"
        )


def _leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every JSON leaf and container below ``value``."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _leaves(v, (*path, i))
    return out


def _get(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


def _set(value: Any, path: tuple, new: Any) -> None:
    _get(value, path[:-1])[path[-1]] = new


def _graphs(program: dict) -> list[dict]:
    data = program["data"]
    graphs = (
        [data["graph"], data["captured"]]
        + [v["graph"] for v in data["variants"]]
        + [t["graph"] for t in data["traces"]]
    )
    return [g for g in graphs if g is not None]


class Mutator:
    def __init__(self, rng: random.Random, marker: Path) -> None:
        self.rng = rng
        self.marker = str(marker)
        self.vocab = sorted(vocabulary())
        self.methods = sorted(TENSOR_METHODS)

    def payload_value(self, names: list[str]) -> Any:
        r = self.rng
        choices = [
            self.marker, f"touch {self.marker}", {"fn": r.choice(DANGEROUS_TARGETS + self.vocab[:50])},
            {"node": r.choice(names)} if names else 0, r.randint(-2, 9), r.random(), None, True, [self.marker],
            {"tuple": [self.marker, {"node": r.choice(names)} if names else 1]}, {"dict": [["key", {"fn": "os.system"}]]},
            {"slice": [0, r.randint(0, 4), None]}, {"dtype": r.choice(["float32", "int64", "bool", "__class__"])},
            {"device": r.choice(["cpu", "meta", "cuda:0"])}, {"tensor": "x"}, {"const": "TAKE_FIRST"}, {"float": "nan"},
            {"node": "__class__"}, {"size": [r.randint(0, 3)]}, {"ellipsis": None}, {"bogus": 1}, {"a": 1, "b": 2},
            {"tuple": [{"tuple": [{"tuple": [self.marker]}]}]},
        ]  # fmt: skip
        return r.choice(choices)

    def mutate(self, program: dict) -> str:
        """Apply one random mutation in place; return its kind."""
        r = self.rng
        graph = r.choice(_graphs(program))
        nodes = graph["nodes"]
        names = [n["name"] for n in nodes]
        kind = r.choice(["target", "target", "method", "attr_path", "args", "args", "args", "getattr", "module_class",
                         "module_attr", "nesting", "insert_node", "drop_node", "op", "tree_child", "kwargs",
                         "deep_nesting", "strided"])  # fmt: skip
        calls = [n for n in nodes if n["op"] == "call_function"]
        if kind == "target" and calls:
            r.choice(calls)["target"] = r.choice(DANGEROUS_TARGETS + r.sample(self.vocab, 20))
        elif kind == "method":
            methods = [n for n in nodes if n["op"] == "call_method"] or nodes[1:-1] or nodes
            node = r.choice(methods)
            node["op"] = "call_method"
            paths = [e["path"] for e in program["modules"] if e["path"]]
            node["target"] = r.choice(DANGEROUS_METHODS + r.sample(self.methods, 5) + paths[:5])
        elif kind == "attr_path":
            node = r.choice([n for n in nodes if n["op"] in ("get_attr", "call_module")] or nodes)
            paths = [e["path"] for e in program["modules"] if e["path"]]
            node["target"] = r.choice(
                DANGEROUS_PATHS + paths + [f"{r.choice(paths or ['x'])}.{r.choice(DANGEROUS_PATHS)}"]
            )
        elif kind == "deep_nesting":  # past the bound: refused before parsing, whatever it holds
            node = r.choice(nodes)
            value = self.payload_value(names)
            for _ in range(r.randint(MAX_NESTING, 2 * MAX_NESTING)):  # json.dumps still writes it
                value = r.choice([{"tuple": [value]}, [value]])
            node["args"] = {"tuple": [value]}
        elif kind == "strided":  # a view of the memory around a value: raises at run time unless within it
            at = r.randint(1, max(1, len(nodes) - 1))
            size = [r.randint(0, 9) for _ in range(r.randint(1, 3))]
            stride = [r.choice([0, 1, 2, 4, 8, 64]) for _ in size]
            args = [{"node": r.choice(names[:at] or names)}, {"tuple": size}, {"tuple": stride}, r.choice([None, 0, 3, 4096])]
            op = r.choice(["call_function", "call_function", "call_method"])
            target = r.choice(STRIDED_TARGETS) if op == "call_function" else r.choice(["as_strided", "as_strided_"])
            nodes.insert(at, {"op": op, "name": f"fuzz_{r.randint(0, 10**6)}", "target": target,
                              "args": {"tuple": args}, "kwargs": {"dict": []}})  # fmt: skip
        elif kind in ("args", "kwargs", "nesting"):
            node = r.choice(nodes)
            spots = _leaves(node["args" if kind != "kwargs" else "kwargs"])
            spot = r.choice(spots)
            field = "args" if kind != "kwargs" else "kwargs"
            value = self.payload_value(names)
            if kind == "nesting":
                for _ in range(r.randint(1, 60)):
                    value = r.choice([{"tuple": [value]}, [value], {"dict": [["k", value]]}])
            if spot:
                _set(node[field], spot, value)
            else:
                node[field] = value
        elif kind == "getattr":
            node = r.choice(calls or nodes)
            node.update(op="call_function", target="builtins.getattr")
            node["args"] = {"tuple": [{"node": r.choice(names)}, r.choice(GETATTR_NAMES)]}
        elif kind == "module_class":
            entry = r.choice(program["modules"])
            entry["class"] = r.choice(
                DANGEROUS_CLASSES + [e.get("class") for e in program["modules"] if e.get("class")]
            )
        elif kind == "module_attr":
            entry = r.choice([e for e in program["modules"] if isinstance(e.get("attrs"), dict)] or program["modules"])
            entry.setdefault("attrs", {})[
                r.choice(["forward", "activation", "p", "__class__", "training", "eps", "x"])
            ] = self.payload_value(names)
        elif kind == "insert_node":
            at = r.randint(1, max(1, len(nodes) - 1))
            target = r.choice(DANGEROUS_TARGETS + r.sample(self.vocab, 5))
            op = r.choice(["call_function", "call_method", "get_attr", "call_module"])
            args = [{"node": r.choice(names[:at])}, self.marker] if names[:at] else [self.marker]
            new = {"op": op, "name": f"fuzz_{r.randint(0, 10**6)}", "target": target if op == "call_function" else
                   r.choice(DANGEROUS_METHODS), "args": {"tuple": args}, "kwargs": {"dict": []}}  # fmt: skip
            nodes.insert(at, new)
        elif kind == "drop_node" and len(nodes) > 2:
            nodes.pop(r.randint(0, len(nodes) - 2))
        elif kind == "op":
            r.choice(nodes)["op"] = r.choice(
                ["placeholder", "get_attr", "call_function", "call_method", "call_module", "output", "x"]
            )
        elif kind == "tree_child":
            entry = r.choice(program["modules"])
            if "children" in entry:
                entry["children"].append(r.choice(["numpy", "tofile", "__class__", "0"]))
                program["modules"].append(
                    {"path": entry["path"] + ("." if entry["path"] else "") + "numpy", "alias": ""}
                )
        return kind


def _walk_ok(value: Any, depth: int = 0) -> bool:
    """A return value of a program: tensors, numbers, strings, None, and containers of them."""
    if depth > 1000:
        return False
    if value is None or isinstance(value, (torch.Tensor, int, float, bool, str, torch.dtype, torch.device, torch.Size)):
        return True
    if isinstance(value, dict):
        return all(_walk_ok(v, depth + 1) for v in value.values())
    if isinstance(value, (tuple, list)):
        return all(_walk_ok(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value):
        return True
    return False


def fuzz(bases: list[Base], work: Path, marker: Path, count: int, seed: int = 0) -> Tally:
    """``count`` mutations spread over ``bases``; raises AssertionError on a forbidden outcome."""
    rng = random.Random(seed)
    mutator = Mutator(rng, marker)
    tally = Tally()
    copies = {}
    for base in bases:
        copies[base.name] = work / f"fuzz_{base.name}"
        shutil.copytree(base.folder, copies[base.name], dirs_exist_ok=True)
    before = sorted(p.name for p in marker.parent.iterdir())
    texts = {base.name: json.dumps(base.program) for base in bases}
    schedule = [base for base in bases for _ in range(base.weight)]
    for i in range(count):
        base = schedule[i % len(schedule)]
        folder = copies[base.name]
        program = json.loads(texts[base.name])
        kinds = [mutator.mutate(program) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        for kind in kinds:
            tally.by_kind[kind] = tally.by_kind.get(kind, 0) + 1
        stale = rng.random() < 0.125  # module.py left as the last mutation's: loads only if it shows this program
        if stale:
            (folder / "program.json").write_text(json.dumps(program))
            rehash(folder)
        else:
            write_program(folder, program)
        tally.tried += 1
        try:
            loaded = dpcompile.load(folder)
        except ExportError:
            tally.refused += 1
        except Exception as e:  # noqa: BLE001 - the failure this fuzzer looks for
            raise AssertionError(f"mutation {i} of {base.name}: load raised {type(e).__name__}: {e}") from e
        else:
            assert "deep_nesting" not in kinds, f"mutation {i} of {base.name}: a program nested past the bound loaded"
            if stale:
                shown = program_source(readable_programs(program["data"], None), class_name=program["class_name"],
                                       mode=program["kind"], devices=program["config"]["devices"])  # fmt: skip
                assert shown == (folder / "module.py").read_text(), f"mutation {i}: loaded with a module.py that is not its program"
            tally.loaded += 1
            try:
                out = base.run(loaded)
            except Exception:  # noqa: BLE001 - a computation that fails is a program's own error
                tally.raised += 1
            else:
                assert _walk_ok(out), f"mutation {i} of {base.name} returned {out!r:.300}: {json.dumps(program)[:3000]}"
                tally.ran += 1
        if marker.exists():
            tally.payloads += 1
            raise AssertionError(f"mutation {i} of {base.name} ran a payload: {json.dumps(program)[:2000]}")
    after = sorted(p.name for p in marker.parent.iterdir())
    assert after == before, f"files appeared: {sorted(set(after) - set(before))}"
    return tally
