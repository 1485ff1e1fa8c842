"""The cost model's constants, measured on the machine at hand: FLOP/s of a matmul and bytes/s of a
device-to-device copy, from a short run (well under a second), cached per device type and torch version.

The cache is a JSON file in ``$DPCOMPILE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dpcompile``, else
``~/.cache/dpcompile``). ``DPCOMPILE_CALIBRATION=off`` skips both the run and the cache and uses
:data:`REFERENCE` (fixed figures, for tests that need the same numbers everywhere);
``DPCOMPILE_CALIBRATION=fresh`` runs again and rewrites the cache.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger("dpcompile")

__all__ = ["REFERENCE", "Calibration", "cache_path", "calibrate"]


@dataclass(frozen=True)
class Calibration:
    """``flops_per_s``: a float32 matmul's FLOP/s; ``copy_bytes_per_s``: a device-to-device copy's
    bytes/s; ``source``: ``"measured"``, ``"cache"`` or ``"reference"`` (calibration off)."""

    flops_per_s: float
    copy_bytes_per_s: float
    device: str = "cpu"
    source: str = "measured"


#: what ``DPCOMPILE_CALIBRATION=off`` uses: round figures of one CPU core (50 GFLOP/s, 5 GB/s)
REFERENCE = Calibration(flops_per_s=5e10, copy_bytes_per_s=5e9, device="any", source="reference")


def cache_path(device_type: str) -> Path:
    """Where the calibration of ``device_type`` is cached (see the module's docstring)."""
    root = os.environ.get("DPCOMPILE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "dpcompile")
    return Path(root) / f"calibration-{device_type}-torch{torch.__version__.split('+')[0]}.json"


def calibrate(device: torch.device | str = "cpu") -> Calibration:
    """The constants for ``device``'s type: from the cache, else measured now and cached."""
    device = torch.device(device)
    setting = os.environ.get("DPCOMPILE_CALIBRATION", "").lower()
    if setting in ("off", "0", "false", "no"):
        return REFERENCE
    path = cache_path(device.type)
    if setting != "fresh" and path.is_file():
        try:
            data = json.loads(path.read_text())
            return Calibration(float(data["flops_per_s"]), float(data["copy_bytes_per_s"]), device.type, "cache")
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.debug("calibration cache %s unreadable (%s): measuring again", path, e)
    measured = Calibration(_matmul_flops_per_s(device), _copy_bytes_per_s(device), device.type, "measured")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps({k: v for k, v in asdict(measured).items() if k != "source"}))
        staging.replace(path)
    except OSError as e:  # a read-only home: the figures still hold for this process
        log.debug("cannot cache the calibration at %s: %s", path, e)
    return measured


def _best_seconds(run, repeats: int = 5) -> float:  # noqa: ANN001 - a thunk
    run()  # warm up
    best = float("inf")
    for _ in range(repeats):
        _synchronize_all()
        start = time.perf_counter()
        run()
        _synchronize_all()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _synchronize_all() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _matmul_flops_per_s(device: torch.device) -> float:
    n = 512 if device.type == "cpu" else 2048
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / _best_seconds(lambda: a @ b)


def _copy_bytes_per_s(device: torch.device) -> float:
    """A copy from ``device`` to the next device of its type (to itself where there is one)."""
    other = device
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        other = torch.device("cuda", ((device.index or 0) + 1) % torch.cuda.device_count())
    x = torch.randn(4 * 2**20 // 4, device=device)  # 4 MiB
    return x.numel() * x.element_size() / _best_seconds(lambda: x.to(other, copy=True))
