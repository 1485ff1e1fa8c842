"""The training state a checkpoint carries beside the weights: optimizer, LR scheduler, RNG, ``extra``.

A folder checkpoint saved with ``optimizer=``, ``lr_scheduler=`` or ``extra=`` holds, beside the
weights, ``optimizer.safetensors`` (or ``optimizer-0000k-of-0000n.safetensors`` shards and
``optimizer.safetensors.index.json``: the optimizer's state tensors under
``optimizer.state.<model key>.<state name>``, each in its parameter's whole layout) and
``training_state.json`` (the layout saved from, the optimizer's kind, hyper-parameters and param
groups by model key, the scheduler's ``state_dict``, the RNG states, ``extra``). The JSON is
written last: it switches the checkpoint over. :func:`prepare_training` checks everything
before a byte is written; :func:`read_training` checks everything before anything is set.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpcompile.checkpoint.dtensors import check_peers, ranks_of
from dpcompile.checkpoint.files import StagedFiles, parse_size, plan_files, tensor_bytes, write_safetensors
from dpcompile.checkpoint.headers import MAX_JSON_BYTES, CheckpointError, parse_json, read_checkpoint, read_metadata
from dpcompile.checkpoint.optimizer_state import SavedState, loaded_state, same_kind, saved_state
from dpcompile.errors import ArgumentError
from dpcompile.modules.weights import weights_loaded

TRAINING_FILE = "training_state.json"
OPTIMIZER_STEM = "optimizer"
OPTIMIZER_FILE = f"{OPTIMIZER_STEM}.safetensors"
OPTIMIZER_INDEX = f"{OPTIMIZER_STEM}.safetensors.index.json"
FORMAT = "dpcompile.training_state"
VERSION = 1
SAVE_KEY = "dpcompile_save"


@dataclass
class TrainingSave:
    """What a save writes beside the weights: the optimizer's tensors and the JSON document."""

    optimizer: SavedState | None
    document: dict[str, Any]


@dataclass
class TrainingLoad:
    """What a load sets once the weights are in: each a callable, or None where not asked for."""

    optimizer: Callable[[], None] | None
    lr_scheduler: Callable[[], None] | None
    rng: Callable[[], None]
    extra: Any

    def finish(self, pm: Any) -> Any:
        """The weights are in: ``pm`` runs again; then the optimizer, the LR scheduler and the RNG are
        set and ``extra`` kept (``pm.checkpoint_extra``). Returns ``pm``."""
        weights_loaded(pm)
        for action in (self.optimizer, self.lr_scheduler, self.rng):
            if action is not None:
                action()
        if self.extra is not None:
            pm.__dict__["checkpoint_extra"] = self.extra
        return pm


def check_training_objects(optimizer: Any, lr_scheduler: Any) -> None:
    """``optimizer=`` a ``torch.optim.Optimizer`` and ``lr_scheduler=`` an object with ``state_dict``
    and ``load_state_dict`` (or None): else ``ValueError`` naming the keyword, before anything is
    read or written."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError(
            f"optimizer={optimizer!r}: expected the torch.optim.Optimizer built on the program's parameters (or None)"
        )
    if lr_scheduler is not None and not all(
        callable(getattr(lr_scheduler, name, None)) for name in ("state_dict", "load_state_dict")
    ):
        raise ArgumentError(f"lr_scheduler={lr_scheduler!r}: expected an LR scheduler (with state_dict and load_state_dict)")


def prepare_training(pm: Any, optimizer: Any, lr_scheduler: Any, extra: Any) -> TrainingSave | None:
    """The training state of a save, checked whole (JSON-able, every parameter placed); None
    where none of ``optimizer``, ``lr_scheduler``, ``extra`` is given."""
    check_training_objects(optimizer, lr_scheduler)
    if optimizer is None and lr_scheduler is None and extra is None:
        return None
    if extra is not None:
        if not isinstance(extra, dict):
            raise ArgumentError(f"extra= must be a dict (JSON-able), not {type(extra).__name__}")
        _dumps(extra, "extra=")
        _refuse_keys_json_renames(extra)
    saved = saved_state(pm, optimizer) if optimizer is not None else None
    document = {
        "format": FORMAT,
        "version": VERSION,
        "saved_from": _layout(pm),
        "optimizer": None if saved is None else encode(saved.meta),
        "lr_scheduler": None if lr_scheduler is None else {
            "kind": _kind(lr_scheduler), "state": encode(lr_scheduler.state_dict()),
        },
        "rng": None,
        "extra": extra,
    }  # fmt: skip
    _dumps(document, "the optimizer's or scheduler's state")
    check_peers(pm)  # over a mesh: every rank checked its own arguments before the first exchange
    document["rng"] = _rng_state(pm)
    return TrainingSave(saved, document)


def write_training(staged: StagedFiles, folder: Path, save: TrainingSave, max_shard_size: int | str) -> set[Path]:
    """Stage the optimizer's files and ``training_state.json`` (last) in ``folder``; returns their final paths."""
    files = optimizer_files(save, folder, max_shard_size)
    tensors = save.optimizer.tensors if save.optimizer is not None else {}
    for file, entries in files.items():
        write_safetensors(staged.temp(file), entries, lambda k: tensors[k][2](), save_stamp(staged.token))
    return set(files) | stage_documents(staged, folder, save, files)


def optimizer_files(save: TrainingSave, folder: Path, max_shard_size: int | str) -> dict[Path, list[Any]]:
    """``{file: [(key, shape, dtype)]}``: where the optimizer's tensors go (one file, or shards past
    ``max_shard_size``); the same on every rank."""
    if save.optimizer is None:
        return {}
    tensors = save.optimizer.tensors
    sizes = [(k, tensor_bytes(shape, dtype)) for k, (shape, dtype, _) in tensors.items()]
    groups = plan_files(sizes, parse_size(max_shard_size))
    n = len(groups)
    names = [OPTIMIZER_FILE] if n == 1 else [f"{OPTIMIZER_STEM}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return {folder / name: [(k, tensors[k][0], tensors[k][1]) for k in group] for name, group in zip(names, groups)}


def stage_documents(staged: StagedFiles, folder: Path, save: TrainingSave, files: dict[Path, list[Any]]) -> set[Path]:
    """Stage the optimizer's index (where its tensors are in several files) and ``training_state.json``
    (staged last: renamed last, it switches the checkpoint over); returns their final paths."""
    written: set[Path] = set()
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(tensor_bytes(shape, dtype) for entries in files.values() for _, shape, dtype in entries)},
            "weight_map": {k: file.name for file, entries in files.items() for k, _, _ in entries},
        }
        staged.write_text(folder / OPTIMIZER_INDEX, json.dumps(index, indent=2))
        written.add(folder / OPTIMIZER_INDEX)
    staged.write_text(folder / TRAINING_FILE, json.dumps({**save.document, "save": staged.token}, indent=1))
    return written | {folder / TRAINING_FILE}


def save_stamp(token: str) -> dict[str, str]:
    """The metadata of every safetensors file of a training save: the save's token, which
    ``training_state.json`` names too, so that a load sees files of two saves mixed."""
    return {"format": "pt", SAVE_KEY: token}


def take_part(save: TrainingSave) -> None:
    """Over a mesh, on the ranks that do not write: the gathers of the optimizer's tensors, in the
    writer's order (each maker is a collective there)."""
    if save.optimizer is not None:
        for _, _, make in save.optimizer.tensors.values():
            make()


def stale_training_files(folder: Path, new: set[Path]) -> list[Path]:
    """The previous save's training files the new one does not replace (removed after the switch)."""
    old = [folder / TRAINING_FILE, folder / OPTIMIZER_INDEX, folder / OPTIMIZER_FILE]
    old += sorted(folder.glob(f"{OPTIMIZER_STEM}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors"))
    return [f for f in old if f not in new and f.is_file()]


def read_training(
    pm: Any, path: Path, optimizer: Any, lr_scheduler: Any, strict: bool, weights: list[Path]
) -> TrainingLoad:
    """Everything a load sets besides the weights, checked and read (each piece's slices only);
    nothing is set yet. Raises :class:`CheckpointError` naming what disagrees."""
    file = path / TRAINING_FILE
    if path.is_dir() and (file.is_symlink() or (file.exists() and not file.is_file())):
        raise CheckpointError(f"{file} is not a regular file", file=file)
    if not path.is_dir() or not file.is_file():
        if optimizer is None and lr_scheduler is None:
            return TrainingLoad(None, None, lambda: None, None)
        raise CheckpointError(
            f"{path} holds no {TRAINING_FILE}: it was saved without optimizer=/lr_scheduler=; load it without them",
            file=path,
        )
    document = read_document(file)
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") != VERSION:
        raise CheckpointError(f"{file} is not a dpcompile training state of version {VERSION}", file=file)
    if optimizer is not None or lr_scheduler is not None:
        _same_save(document, file, weights)

    def state_of(meta: dict[str, Any]) -> dict[str, Any]:
        files = read_checkpoint(path, stem=OPTIMIZER_STEM) if meta["state"] else None
        _same_save(document, file, files.files() if files is not None else [])
        return loaded_state(pm, optimizer, meta, files, strict)

    return training_from_document(pm, document, file, optimizer, lr_scheduler, state_of)


def read_document(file: Path) -> Any:
    """The JSON of ``training_state.json``, read as the index json is: bounded size and nesting,
    UTF-8, no key twice; else :class:`CheckpointError` naming ``file``."""
    try:
        size = file.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{file} is {size} bytes, more than a training state can be ({MAX_JSON_BYTES})", file=file)
        text = file.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read as UTF-8 JSON text ({e})", file=file) from None
    return parse_json(text, file, "the training state")


def training_from_document(
    pm: Any,
    document: dict[str, Any],
    file: Path,
    optimizer: Any,
    lr_scheduler: Any,
    state_of: Callable[[dict[str, Any]], dict[str, Any]],
) -> TrainingLoad:
    """What a load sets from a training state ``document`` (read from ``file``): the optimizer's
    ``state_dict`` (``state_of(meta)`` reads its tensors), the scheduler's, the RNG, ``extra``;
    checked and read, nothing set yet."""
    path = file.parent
    load_optimizer = None
    if optimizer is not None:
        meta = document.get("optimizer")
        if meta is None:
            raise CheckpointError(
                f"{file} has no 'optimizer' entry: {path} was saved without optimizer= (there is no optimizer state "
                "to load), or the file was edited; load it without optimizer=", file=file,
            )
        try:
            sd = state_of(decode(meta))  # betas come back a tuple, as saved
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise CheckpointError(
                f"{file}: its optimizer entry is malformed ({type(e).__name__}: {e})", file=file
            ) from None
        _try_optimizer_state(optimizer, sd, file)
        load_optimizer = lambda: optimizer.load_state_dict(sd)  # noqa: E731
    load_scheduler = None
    if lr_scheduler is not None:
        saved = document.get("lr_scheduler")
        if saved is None:
            raise CheckpointError(
                f"{file} has no 'lr_scheduler' entry: {path} was saved without lr_scheduler= (there is no scheduler "
                "state), or the file was edited; load it without lr_scheduler=", file=file,
            )  # fmt: skip
        if not isinstance(saved, dict) or not isinstance(saved.get("kind"), str) or not isinstance(saved.get("state"), dict):
            raise CheckpointError(f"{file}: its lr_scheduler entry is not {{'kind': str, 'state': {{...}}}}", file=file)
        if saved["kind"] != _kind(lr_scheduler):
            raise CheckpointError(
                f"{file} holds a {saved['kind']}'s state, the scheduler is a {_kind(lr_scheduler)}", file=file
            )
        try:
            state = decode(saved["state"])
        except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"{file}: its lr_scheduler state is malformed ({type(e).__name__}: {e})", file=file
            ) from None
        _try_scheduler_state(lr_scheduler, state, file)
        load_scheduler = lambda: lr_scheduler.load_state_dict(state)  # noqa: E731
    rng = _checked_rng(file, _own_rng(pm, document.get("rng") or {}))  # set last: checked now, so that it cannot fail then
    extra = document.get("extra")
    if extra is not None and not isinstance(extra, dict):  # a save writes a dict (extra= is checked so)
        raise CheckpointError(f"{file}: its extra entry is a {type(extra).__name__}, not the dict a save writes", file=file)
    return TrainingLoad(load_optimizer, load_scheduler, lambda: _set_rng(rng), extra)


def _try_optimizer_state(optimizer: Any, sd: dict[str, Any], file: Path) -> None:
    """Load ``sd`` into ``optimizer`` and put its own state back: a state the optimizer refuses (an
    entry lacking ``step``, ...) raises here, before the weights are written, never halfway through
    the load. The state's tensors are the ones read (``load_state_dict`` copies none of its dtype and
    device), so the trial costs no memory."""
    kept = {name: optimizer.__dict__[name] for name in ("state", "param_groups")}
    try:
        optimizer.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001 - torch's optimizers fail on a bad state in many ways
        raise CheckpointError(
            f"{file}: the optimizer refuses the state it describes ({type(e).__name__}: {str(e)[:160]}); the checkpoint "
            "is corrupt or edited: save again, or load without optimizer=", file=file,
        ) from None  # fmt: skip
    finally:
        optimizer.__dict__.update(kept)


def _try_scheduler_state(lr_scheduler: Any, state: Any, file: Path) -> None:
    """Refuse a scheduler state with a key the scheduler's own ``state_dict`` lacks (``load_state_dict``
    sets each as an attribute: ``optimizer`` would replace its optimizer), a value of another kind
    than the scheduler's (``last_epoch`` a string), or one its ``load_state_dict`` refuses; nothing set."""
    current = lr_scheduler.state_dict()
    unknown = sorted(str(k) for k in state if k not in current)
    wrong = sorted(str(k) for k in state if k in current and not same_kind(state[k], current[k], none_holds=(bool, int, float, str)))
    if unknown or wrong:
        raise CheckpointError(
            f"{file}: its lr_scheduler state has keys this {_kind(lr_scheduler)} does not hold {unknown[:5]} or values of "
            f"another kind {wrong[:5]}; the checkpoint is corrupt or edited (or from another scheduler): save again, or "
            "load without lr_scheduler=", file=file,
        )  # fmt: skip
    kept = dict(lr_scheduler.__dict__)
    try:
        lr_scheduler.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 - a scheduler's own check
        raise CheckpointError(
            f"{file}: the lr_scheduler refuses its state ({type(e).__name__}: {str(e)[:160]})", file=file
        ) from None
    finally:
        lr_scheduler.__dict__.clear()
        lr_scheduler.__dict__.update(kept)


def _same_save(document: dict[str, Any], file: Path, files: list[Path]) -> None:
    """Every file carries the token of the save ``training_state.json`` names, or the load is refused."""
    token = document.get("save")
    for f in files:
        stamp = read_metadata(f).get(SAVE_KEY)
        if stamp != token:
            raise CheckpointError(
                f"{f.name} is not from the save {file.name} describes ({stamp} vs {token}): the folder mixes two saves "
                "(a crash during a save's final renames, or files copied in); load the weights alone or save again",
                file=f,
            )


def encode(value: Any) -> Any:
    """JSON-able form of a state_dict: tuples, tensors and non-string keys kept recoverable by :func:`decode`."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    return value


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    return {k: decode(v) for k, v in value.items()}


def _refuse_keys_json_renames(value: Any, where: str = "extra") -> None:
    """A dict key JSON writes as a string (``{1: ...}`` comes back as ``{"1": ...}``): refused, not renamed."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if isinstance(value, dict) and not isinstance(key, str):
            raise ArgumentError(
                f"extra= must be JSON-able for a checkpoint: the key {key!r} of {where} is a {type(key).__name__}, which "
                "JSON writes as a string (load_checkpoint would give back another dict); use string keys. Nothing was written"
            )
        _refuse_keys_json_renames(item, f"{where}[{key!r}]")


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{what} must be JSON-able for a checkpoint ({e}); nothing was written") from None


def _layout(pm: Any) -> dict[str, Any]:
    devices = getattr(pm, "devices", None)
    mesh = getattr(pm, "mesh", None)
    return {
        "program": type(pm).__name__,
        "layout": encode(getattr(pm, "layout", None)),
        "strategies": encode(getattr(pm, "strategies", None)),
        "devices": [str(d) for d in devices] if devices is not None else None,
        "mesh": str(mesh) if mesh is not None else None,
    }


def _kind(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _rng_state(pm: Any) -> dict[str, Any]:
    """The CPU generator's state, and each CUDA device's where CUDA is in use; over a mesh every
    rank's too (``ranks``), so that each rank of the same mesh size gets its own back (another
    number of ranks gets rank 0's)."""
    out: dict[str, Any] = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    over, group = ranks_of(pm)
    if over:
        import torch.distributed as dist

        ranks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, dict(out), group=group)
        out = {**ranks[0], "ranks": ranks}  # the same document on every rank (a DCP save writes any rank's)
    return out


def _own_rng(pm: Any, rng: Any) -> Any:
    """This rank's RNG states where the save had as many ranks; else the saving rank 0's."""
    over, group = ranks_of(pm)
    ranks = rng.get("ranks") if isinstance(rng, dict) else None
    if over and isinstance(ranks, list):
        import torch.distributed as dist

        if len(ranks) == dist.get_world_size(group):
            return ranks[dist.get_rank(group)]
    return rng


def _checked_rng(file: Path, rng: Any) -> dict[str, Any]:
    """``{"cpu": state, "cuda": [states]}`` decoded from the document's ``rng`` entry, each state of
    the size torch sets; else :class:`CheckpointError` naming ``file``."""

    def state(text: Any, size: int | None, what: str) -> torch.Tensor:
        try:
            value = _unb64(text) if isinstance(text, str) else None
        except ValueError:
            value = None
        if value is None or (size is not None and value.numel() != size):
            raise CheckpointError(
                f"{file}: its rng entry's {what} state is not the base64 of {size or 'a'} byte(s) torch saved "
                "(edited or corrupt); remove the 'rng' entry to load without restoring the random state",
                file=file,
            )
        return value

    if not isinstance(rng, dict) or not isinstance(rng.get("cuda", []), list):
        raise CheckpointError(f"{file}: its rng entry is not {{'cpu': str, 'cuda': [str]}} (edited or corrupt)", file=file)
    out: dict[str, Any] = {}
    if "cpu" in rng:
        out["cpu"] = state(rng["cpu"], torch.get_rng_state().numel(), "cpu")
    if rng.get("cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        size = torch.cuda.get_rng_state(0).numel() if count else None
        out["cuda"] = [state(s, size, f"cuda:{k}") for k, s in enumerate(rng["cuda"][:count])]
    return out


def _set_rng(rng: dict[str, Any]) -> None:
    """Set the states :func:`_checked_rng` decoded."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    for device, state in enumerate(rng.get("cuda", [])):
        torch.cuda.set_rng_state(state, device)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


__all__ = [
    "OPTIMIZER_FILE", "OPTIMIZER_INDEX", "TRAINING_FILE", "TrainingLoad", "TrainingSave", "check_training_objects", "decode", "encode",
    "optimizer_files", "prepare_training", "read_training", "training_from_document", "save_stamp", "stage_documents", "stale_training_files",
    "take_part", "write_training",
]  # fmt: skip
