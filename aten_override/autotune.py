r"""Measured kernel choice of the compiled backend: the setting, and the results file.

The compiled backend can serve a call with several kernels (``candidates``: native itself, the
depthwise kernel's three walks, the direct, grouped-lanes, GEMM, Winograd and fused pointwise kernels of
``csrc/cpu``, each with a predicate of what it computes). With autotune on, the first call of a *signature* (sizes, strides, dtype, ``output_mask``,
stride / padding / dilation / groups, bias, the thread count) times every candidate that applies on
the call's own tensors (native's first run untimed, the reference; each candidate once, checked
against it; an interleaved round of all; two more of native and the candidates within 2x of the
fastest, none where the fastest run took 20 ms or more; each timed run starts with the caches
flushed when the call's tensors would stay cached; each candidate's fastest run decides; a call
asking for both gradients also times each gradient alone (twice, once for a 20 ms call), and a
*split* ``"a+b"`` — grad_input and grad_bias from kernel ``a``, grad_weight from ``b`` — wins when those two together beat every whole kernel), and remembers the winner; a candidate must beat native by 3% to win. Later calls of that signature take the winner after one hash lookup in
C++. With autotune off, or under ``torch.use_deterministic_algorithms(True)``, the layer-class table
decides (no timing), so results do not depend on machine load.

As ``torch.cuda.tunable`` does for GEMMs, the results can live in a file: entries keyed by
signature, with a header that must match this process (torch and oneDNN versions, CPU model and
ISA flags, the extension's build id) or the whole file is ignored, saying why.

Settings (``enable("compiled", autotune=...)``, or ``ATEN_OVERRIDE_AUTOTUNE`` when not given):

- ``True`` / ``"1"`` (the default): tune in memory, for this process;
- ``False`` / ``"0"``: the layer-class table decides;
- a path (``"tune.json"``): tune, reading that file's valid entries on entering and writing the
  table back on leaving the ``enable`` block (and at interpreter exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # (not on Windows: saving does not lock there)
    fcntl = None

import torch

from . import _machine

__all__ = ["ENV", "Setting", "setting", "header", "load", "save", "entries", "clear", "file_info"]

ENV = "ATEN_OVERRIDE_AUTOTUNE"
FORMAT = 1

log = logging.getLogger("aten_override.autotune")

_FALSE = {"0", "false", "off", "no"}
_TRUE = {"1", "true", "on", "yes", ""}


@dataclasses.dataclass(frozen=True)
class Setting:
    """``enabled``: whether first calls tune; ``path``: the results file, or ``None``."""

    enabled: bool
    path: Path | None = None


def setting(value: bool | str | os.PathLike | None = None) -> Setting:
    """The setting for ``enable(..., autotune=value)``; ``None`` reads ``ATEN_OVERRIDE_AUTOTUNE``
    (unset: on, in memory).

    Raises:
        TypeError: ``value`` is not a bool, a string, a path or ``None``.
    """
    if value is None:
        value = os.environ.get(ENV, "1")
    if isinstance(value, bool):
        return Setting(value)
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.strip().lower() in _FALSE:
            return Setting(False)
        if text.strip().lower() in _TRUE:
            return Setting(True)
        # resolved now: the file read on entering enable() is the one written on leaving it
        return Setting(True, Path(text).expanduser().absolute())
    raise TypeError(f"aten_override: autotune must be a bool, a path or None, got {type(value).__name__}")


def _ext():
    from .ops.convolution_backward import compiled

    return compiled.extension()


_build_id: str | None = None


def _extension_build_id() -> str:
    """A hash of the loaded extension's shared library: a rebuilt kernel invalidates its timings."""
    global _build_id
    if _build_id is None:
        ext = _ext()
        _build_id = hashlib.sha1(Path(ext.__file__).read_bytes()).hexdigest()[:16] if ext is not None else "none"
    return _build_id


def header() -> dict:
    """What a results file must have been measured with to be used here."""
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "onednn": _machine.onednn_version(),
        "cpu_model": _machine.cpu_model(),
        "isa": list(_machine.isa_flags()),
        "build_id": _extension_build_id(),
    }


def _stale_reason(found) -> str | None:
    if not isinstance(found, dict):
        raise TypeError(f"the header is a {type(found).__name__}, not an object")
    wanted = header()
    for key, value in wanted.items():
        if found.get(key) != value:
            return f"{key} is {found.get(key)!r} in the file, {value!r} here"
    return None


# The measurements a results file recorded for the entries this process took from it, by signature:
# the C++ table keeps only a loaded entry's kernel, so without these a file written back after being
# reused (every ``enable(autotune=path)`` block, and interpreter exit) lost why each kernel won.
_loaded_records: dict[str, dict] = {}


def _record_of(row: dict) -> dict | None:
    """``{"kernel", "times_us", "rejected", "tune_us"}`` of a results file's entry, or ``None`` where
    its measurements are not of the form :func:`save` writes (the entry itself may still be taken)."""
    times, rejected, tune_us = row.get("times_us"), row.get("rejected"), row.get("tune_us")
    if not (isinstance(times, dict) and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in times.items())):
        return None
    if not (isinstance(rejected, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in rejected.items())):
        return None
    if not isinstance(tune_us, (int, float)):
        return None
    return {"kernel": str(row["kernel"]), "times_us": dict(times), "rejected": dict(rejected), "tune_us": float(tune_us)}


def entries() -> list[dict]:
    """The in-memory results table: ``[{"signature", "kernel", "times_us", "rejected", "tune_us"}]``
    (times in microseconds; empty for entries loaded from a file: this process measured nothing for
    them, and :func:`save` writes the file's own measurements back for them)."""
    ext = _ext()
    if ext is None:
        return []
    return [
        {"signature": sig, "kernel": kernel, "times_us": times, "rejected": rejected, "tune_us": tune_us}
        for sig, kernel, times, rejected, tune_us in ext.autotune_entries()
    ]


def _as_recorded(row: dict) -> dict:
    """An :func:`entries` row as the file it was loaded from recorded it, where it was loaded (its
    kernel unchanged, nothing measured in this process)."""
    record = _loaded_records.get(row["signature"])
    if row["times_us"] or row["tune_us"] or record is None or record["kernel"] != row["kernel"]:
        return row
    return {**row, "times_us": record["times_us"], "rejected": record["rejected"], "tune_us": record["tune_us"]}


def clear() -> None:
    """Forget every tuned signature of this process."""
    ext = _ext()
    if ext is not None:
        ext.autotune_clear()
    _loaded_records.clear()


# What reading a results file can raise (a missing or malformed field, a non-JSON file, nesting too deep).
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, RecursionError)


def _unreadable(e: BaseException) -> str:
    return f"unreadable ({type(e).__name__}: {e})"


def _read_file(path: Path) -> tuple[dict | None, str | None]:
    """``(data, why)`` of the results file at ``path``: its parsed JSON (``None`` where unreadable) and
    why it is not used: ``None``, ``"unreadable (<error>)"``, or ``"measured elsewhere (<what
    differs>)"`` (:func:`_stale_reason`). ``data["entries"]`` exists and has a length."""
    try:
        data = json.loads(path.read_text())
        stale = _stale_reason(data["header"])
        len(data["entries"])
    except _UNREADABLE as e:
        return None, _unreadable(e)
    return data, None if stale is None else f"measured elsewhere ({stale})"


def load(path: str | os.PathLike) -> int:
    """Add the valid entries of the results file ``path`` to the table; returns how many were taken.
    A signature the table already holds (tuned in this process, or read before: each
    ``enable(autotune=path)`` reads the file again) keeps the table's choice and counts as taken.

    A missing file takes nothing; a corrupt one, or one measured elsewhere (another torch, oneDNN,
    CPU model, ISA or build), is ignored as a whole with a warning on the ``aten_override.autotune``
    logger that says why.
    """
    path = Path(path)
    ext = _ext()
    if ext is None or not path.exists():
        return 0
    data, why = _read_file(path)
    if why is None:
        try:
            rows = [(str(r["signature"]), str(r["kernel"])) for r in data["entries"]]
        except _UNREADABLE as e:
            why = _unreadable(e)
    if why is not None:
        log.warning("aten_override: ignoring autotune results file %s: %s; results written to it replace it "
                    "(keep one file per machine and build)", path, why)
        return 0
    taken = ext.autotune_load(rows)
    for row in data["entries"]:  # dicts with a signature and a kernel: `rows` above read them
        if (record := _record_of(row)) is not None:
            _loaded_records[str(row["signature"])] = record
    if taken < len(rows):
        log.warning("aten_override: %d of %d entries of %s were not usable", len(rows) - taken, len(rows), path)
    return taken


_save_lock = threading.Lock()


def _entries_on_disk(path: Path) -> list[dict]:
    """The entries of the results file at ``path`` that another process of this machine wrote (header
    matching this process; each with a signature and a kernel, its measurements as :func:`_record_of`
    reads them, empty where malformed); ``[]`` for a missing, unreadable or stale file."""
    data, why = _read_file(path)
    if why is not None:
        return []
    rows = [r for r in data["entries"] if isinstance(r, dict) and "signature" in r and "kernel" in r]
    empty = {"times_us": {}, "rejected": {}, "tune_us": 0.0}
    return [{"signature": str(r["signature"]), **empty, **(_record_of(r) or {"kernel": str(r["kernel"])})} for r in rows]


def save(path: str | os.PathLike) -> int:
    """Write the table (with :func:`header`) to ``path``, atomically; returns the number of entries.
    Entries loaded from a file keep the measurements it recorded for them. Entries the file holds now
    that this process's table lacks (written by another process since it was read: two DDP ranks, two
    scripts sharing ``ATEN_OVERRIDE_AUTOTUNE``) are kept, read again under an exclusive lock of the
    file's directory (``fcntl.flock``, where there is one); a file measured elsewhere, or unreadable, is
    replaced."""
    path = Path(path)
    rows = [_as_recorded(row) for row in entries()]
    with _save_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the directory is locked while the file is read and replaced (no lock file left behind)
        directory = os.open(path.parent, os.O_RDONLY) if fcntl is not None else None
        try:
            if directory is not None:
                fcntl.flock(directory, fcntl.LOCK_EX)
            ours = {row["signature"] for row in rows}
            rows += [row for row in _entries_on_disk(path) if row["signature"] not in ours]
            data = {"header": header(), "entries": rows}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        finally:
            if directory is not None:
                os.close(directory)  # (releases the lock)
    return len(rows)


def file_info(path: str | os.PathLike) -> dict:
    """``{"path", "exists", "entries", "valid", "why"}`` for ``python -m aten_override info``."""
    path = Path(path)
    out = {"path": str(path), "exists": path.exists(), "entries": 0, "valid": False, "why": None}
    if not path.exists():
        out["why"] = "no such file"
        return out
    data, why = _read_file(path)
    if data is not None:
        out["entries"] = len(data["entries"])
    out["why"], out["valid"] = why, why is None
    return out


# --- applying a setting (context.enable) ----------------------------------------------------------

_files_to_save: set[Path] = set()


def apply(s: Setting) -> bool | None:
    """Switch the extension to ``s``; returns the previous on/off state to :func:`restore` (``None``
    when the extension is not built). Loads ``s.path`` when given."""
    ext = _ext()
    if ext is None:
        return None
    previous = ext.autotune()
    ext.set_autotune(s.enabled)
    if s.path is not None:
        load(s.path)
        _files_to_save.add(s.path)
    return previous


def restore(s: Setting, previous: bool | None) -> None:
    """Undo :func:`apply`: write ``s.path`` back, restore the previous on/off state."""
    ext = _ext()
    if ext is None or previous is None:
        return
    if s.path is not None:
        try:
            save(s.path)
        except OSError as e:
            log.warning("aten_override: could not write autotune results file %s: %s", s.path, e)
    ext.set_autotune(previous)


@atexit.register
def _save_at_exit() -> None:
    for path in list(_files_to_save):
        try:
            save(path)
        except Exception as e:  # noqa: BLE001 - never fail interpreter exit
            log.warning("aten_override: could not write autotune results file %s: %s", path, e)
