"""Warm start: PyTorch's compile-cache artifacts, saved at the end of a run, loaded at setup.

``compile_cache=PATH`` makes the engine call :func:`load` in ``setup`` (every
rank, before anything compiles) and :func:`save` in ``finish`` (rank zero only).
The artifacts are ``torch.compiler.save_cache_artifacts()``'s bytes: Inductor's
FX graph cache and AOTAutograd's cache entries (and Dynamo's PGO profiles) that
this process recorded. ``torch.compiler.load_cache_artifacts`` writes them into
the local caches (``TORCHINDUCTOR_CACHE_DIR``), so it must run before the first
compile; Inductor then finds them there like any cache entry (its keys and
guards still decide whether an entry is used, so a stale artifact costs a cold
compile, never a wrong result). The caches need inductor's ``fx_graph_cache``
(on by default; the AOTAutograd cache also needs it) and no ``force_disable_caches``;
only the inductor backend records artifacts.

The file is guardtrain's: one header line (format, torch and Python versions,
SHA-256 of the payload) before torch's bytes. A file that is not one, is
truncated or corrupt, or was saved by another torch or Python is refused with
one warning, and the run compiles cold. It is written atomically (a temporary
file in the same folder, then ``os.replace``).

Every function returns or updates one plain dict, the summary's ``compile_cache``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from guardtrain._torch import cache_artifacts, dynamo_counters, fx_graph_cache_on

if TYPE_CHECKING:
    from guardtrain.engine.host import Host

__all__ = [
    "MAGIC",
    "RejectedFile",
    "caches_off",
    "counts",
    "decode",
    "describe",
    "encode",
    "hits",
    "load",
    "save",
    "summary",
    "write_atomic",
]

MAGIC = b"guardtrain compile cache\n"
"""The first bytes of every file guardtrain writes."""
FORMAT = 1
"""The version of the header; a file with another one is refused."""
_HIT_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))


class RejectedFile(ValueError):
    """The file is not a compile cache this process can use; the message says why."""


def _versions() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def encode(payload: bytes) -> bytes:
    """The file's bytes: the header line (versions, checksum), then torch's ``payload``."""
    header = {"format": FORMAT, **_versions(), "sha256": hashlib.sha256(payload).hexdigest()}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def decode(data: bytes) -> bytes:
    """Torch's payload from a file's bytes.

    Raises:
        RejectedFile: not guardtrain's format, a bad header or checksum, or saved by
            another torch or Python.
    """
    if not data.startswith(MAGIC):
        raise RejectedFile("not a guardtrain compile cache (unknown header)")
    line, sep, payload = data[len(MAGIC) :].partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise RejectedFile("corrupt header")
    if header.get("format") != FORMAT:
        raise RejectedFile(f"format {header.get('format')!r}, this guardtrain reads {FORMAT}")
    for key, mine in _versions().items():
        if header.get(key) != mine:
            raise RejectedFile(f"saved by {key} {header.get(key)}, this is {key} {mine}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise RejectedFile("corrupt or truncated (checksum mismatch)")
    return payload


def unreadable_entry(payload: bytes) -> str | None:
    """The first Inductor entry in torch's ``payload`` that does not unpickle, named, or None.

    Through torch 2.14, ``load_cache_artifacts`` unpickles each Inductor entry (to
    find its Triton bundle) and raises on a bad one; torch 2.15 writes the bytes
    as they are and meets a bad entry only when a compile looks it up (a warning
    in torch's log, and a cold compile). guardtrain unpickles them itself, as 2.14
    did, so every torch refuses such a file at load with one warning. None also
    when torch's artifacts cannot be listed here: ``load_cache_artifacts`` decides.
    """
    import pickle

    try:
        artifacts = cache_artifacts(payload)
    except Exception:
        return None
    for artifact in (artifacts or {}).get("inductor", ()):
        try:
            pickle.loads(artifact.content)
        except Exception as err:
            return (
                f"Inductor entry {getattr(artifact, 'key', '?')!r} does not unpickle: "
                f"{type(err).__name__}: {err}"
            )
    return None


def counts(info: Any) -> dict[str, int]:
    """Artifacts per cache (``inductor``, ``aot_autograd``, ...) in a ``CacheInfo``."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in sorted(artifacts.items()) if keys}


def hits() -> dict[str, int]:
    """Inductor's and AOTAutograd's cache hits in this process so far (Dynamo's counters)."""
    counters = dynamo_counters()
    return {group: int(counters[group][name]) for group, name in _HIT_COUNTERS}


def caches_off(compile_kwargs: dict[str, Any]) -> str | None:
    """Why no artifact can be recorded or used (the FX graph cache is off), else None."""
    options = compile_kwargs.get("options") or {}
    if options.get("force_disable_caches", torch.compiler.config.force_disable_caches):
        return "torch.compiler.config.force_disable_caches is on"
    if not options.get("fx_graph_cache", fx_graph_cache_on()):
        return "inductor's fx_graph_cache is off"
    return None


@contextlib.contextmanager
def _quiet_torch_cache_log() -> Iterator[None]:
    """Torch logs its own warning (with a traceback) when it cannot read artifacts;
    guardtrain gives one warning instead."""
    logger = logging.getLogger("torch.compiler._cache")

    def drop(record: logging.LogRecord) -> bool:
        return False

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def load(path: str, host: Host, compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Load the artifacts at ``path`` into the local caches; before the first compile.

    A missing file gives one INFO line; an unusable one a warning. Never raises
    for a bad file: the run then compiles cold.

    Returns:
        The summary's ``compile_cache`` dict: ``path``, ``load`` (``"loaded"``,
        ``"missing"``, ``"rejected"``, ``"off"``), ``loaded`` (artifacts per cache),
        ``why``, and the hit counters at load time (``hits`` is filled in by :func:`save`).
    """
    status: dict[str, Any] = {
        "path": path,
        "load": "missing",
        "loaded": {},
        "load_s": 0.0,
        "why": None,
        "hits": {},
        "save": None,
        "saved": {},
        "bytes": 0,
        "_hits_at_load": hits(),
    }
    off = caches_off(compile_kwargs)
    if off is not None:
        status.update(load="off", why=off)
        host.warn(
            f"guardtrain: compile_cache={path!r} does nothing: {off}, so PyTorch records "
            "and reads no compile-cache artifacts."
        )
        return status
    start = time.perf_counter()
    try:
        with open(os.path.expanduser(path), "rb") as file:
            data = file.read()
    except FileNotFoundError:
        host.info(
            f"guardtrain: compile cache {path!r} does not exist yet (first run): compiling "
            "cold; the artifacts are saved there at the end of the run."
        )
        return status
    except OSError as err:
        return _rejected(status, host, f"cannot read it ({err})")
    try:
        payload = decode(data)
        with _quiet_torch_cache_log():
            bad = unreadable_entry(payload)
            if bad is not None:
                raise RejectedFile(f"torch could not load it ({bad})")
            info = torch.compiler.load_cache_artifacts(payload)
    except RejectedFile as err:
        return _rejected(status, host, str(err))
    except Exception as err:  # torch failed while writing the local caches
        return _rejected(status, host, f"torch could not load it ({type(err).__name__}: {err})")
    if info is None:
        return _rejected(status, host, "torch could not read its artifacts")
    status.update(load="loaded", loaded=counts(info), load_s=time.perf_counter() - start)
    status["bytes"] = len(data)
    host.info(f"guardtrain: loaded compile cache {path!r}: {_describe(status['loaded'])}.")
    return status


def _rejected(status: dict[str, Any], host: Host, why: str) -> dict[str, Any]:
    status.update(load="rejected", why=why)
    host.warn(
        f"guardtrain: compile cache {status['path']!r} is not used: {why}. Compiling cold; "
        "the artifacts this run records replace the file at its end."
    )
    return status


def save(status: dict[str, Any], host: Host, rank: int) -> None:
    """At the end of a run: on rank zero, write this process's artifacts to the file.

    Updates ``status``: ``save`` (``"saved"``, ``"empty"``, ``"failed"``, ``"rank N"``),
    ``saved`` (artifacts per cache), ``bytes``, ``hits`` (cache hits since the load).
    """
    before = status.get("_hits_at_load", {})
    status["hits"] = {k: n - before.get(k, 0) for k, n in hits().items() if n > before.get(k, 0)}
    if status["load"] == "off":
        return
    if rank != 0:
        status["save"] = f"rank {rank}: rank zero saves"
        return
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as err:
        _save_failed(status, host, f"{type(err).__name__}: {err}")
        return
    if saved is None:
        status["save"] = "empty"
        host.info(
            f"guardtrain: no compile-cache artifacts to save to {status['path']!r}: only the "
            "inductor backend records them."
        )
        return
    payload, info = saved
    data = encode(payload)
    try:
        write_atomic(os.path.expanduser(status["path"]), data)
    except OSError as err:
        _save_failed(status, host, str(err))
        return
    status.update(save="saved", saved=counts(info), bytes=len(data))


def _save_failed(status: dict[str, Any], host: Host, why: str) -> None:
    status["save"] = "failed"
    status["why"] = why
    host.warn(f"guardtrain: could not save the compile cache to {status['path']!r}: {why}.")


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder and ``os.replace``.

    Creates the folder if needed; a reader sees the old file or the new one, never a part.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def summary(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plain dict for ``GuardEngine.summary()`` (no private keys)."""
    if status is None:
        return None
    return {
        k: dict(v) if isinstance(v, dict) else v for k, v in status.items() if not k.startswith("_")
    }


def _describe(per_cache: dict[str, int]) -> str:
    total = sum(per_cache.values())
    parts = ", ".join(f"{kind} {n}" for kind, n in per_cache.items())
    return f"{total} artifact{'s' if total != 1 else ''}" + (f" ({parts})" if parts else "")


def describe(cc: dict[str, Any]) -> str:
    """One line for the summary table."""
    load = cc.get("load")
    if load == "loaded":
        text = f"loaded {_describe(cc.get('loaded', {}))}"
    elif load == "missing":
        text = "no file yet (cold)"
    elif load == "off":
        text = f"off ({cc.get('why')})"
    else:
        text = f"rejected ({cc.get('why')}), compiled cold"
    found = cc.get("hits") or {}
    if found:
        text += "; hits " + ", ".join(f"{kind} {n}" for kind, n in found.items())
    save = cc.get("save")
    if save == "saved":
        text += f"; saved {_describe(cc.get('saved', {}))}"
    elif save == "empty":
        text += "; nothing to save (inductor only)"
    elif save == "failed":
        text += f"; save failed ({cc.get('why')})"
    elif save:
        text += f"; {save}"
    return f"{text}  [{cc.get('path')}]"
