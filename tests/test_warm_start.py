"""Warm start (``compile_cache``): PyTorch's compile-cache artifacts saved and loaded.

The fast tests use the eager backend, which records no artifacts: the ``artifacts``
fixture gives each test a fresh artifact manager and Inductor cache folder, and
records one stand-in artifact where a test needs a file to be written. The slow
test compiles with inductor in two processes, each with a fresh
``TORCHINDUCTOR_CACHE_DIR``, and checks that the second one compiles from the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Net, TinyModule, compare, fit, guard, guard_tuner, loaders
from torch.compiler._cache import CacheArtifactManager

from guardtrain import GuardTrainTypeError, GuardTrainValueError, GuardTuneCallback, GuardTuner
from guardtrain.engine import warmstart

ROOT = Path(__file__).resolve().parents[1]
RANK_ZERO = "lightning.pytorch.utilities.rank_zero"
MISSING = "does not exist yet"
NOT_USED = "is not used"


@pytest.fixture
def artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """An empty artifact manager and Inductor cache folder; calling it records one artifact."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    CacheArtifactManager._ensure_cache_artifacts_registered()

    def record() -> None:
        # Loading unpickles an Inductor entry to find its Triton bundle: a namespace will do.
        content = pickle.dumps(types.SimpleNamespace(_triton_bundle=None))
        CacheArtifactManager.record_artifact("inductor", "fwarmstarttest", content)

    with CacheArtifactManager.with_fresh_cache():
        yield record


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _ours(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "compile cache" in str(w.message)]


def _steps(model: torch.nn.Module, tuner: GuardTuner | None, batches: int = 8) -> list[float]:
    """Training steps on fixed data (through ``tuner.step`` when given); returns the losses."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(batches):
        x = torch.randn(16, 8, generator=g)
        with tuner.step((x,)) if tuner is not None else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("constructor", ["GuardTuneCallback", "GuardTuner"])
@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3, GuardTrainTypeError, r"`compile_cache` must be a file path .* got 3 \(int\)"),
        (b"c.bin", GuardTrainTypeError, r"`compile_cache` must be a file path .* got b'c.bin'"),
        ("", GuardTrainValueError, r"`compile_cache` must name a file .* got ''"),
        ("TMP", GuardTrainValueError, r"`compile_cache` must name a file"),  # a folder
    ],
    ids=["int", "bytes", "empty", "folder"],
)
def test_bad_compile_cache_is_refused(
    constructor: str, value: Any, error: type[Exception], match: str, tmp_path: Path
) -> None:
    value = str(tmp_path) if value == "TMP" else value
    with pytest.raises(error, match=match):
        if constructor == "GuardTuneCallback":
            GuardTuneCallback(compile_cache=value)
        else:
            GuardTuner(Net(), compile_cache=value)


def test_path_like_is_kept_as_a_string(tmp_path: Path) -> None:
    cb = GuardTuneCallback(compile_cache=tmp_path / "new" / "c.bin")
    assert cb.compile_cache == str(tmp_path / "new" / "c.bin")
    assert GuardTuneCallback().compile_cache is None
    assert GuardTuneCallback().summary()["compile_cache"] is None


# -- the file --------------------------------------------------------------------------------


def test_file_format_round_trips_and_refuses_bad_files() -> None:
    data = warmstart.encode(b"payload")
    assert warmstart.decode(data) == b"payload"
    with pytest.raises(warmstart.RejectedFile, match="unknown header"):
        warmstart.decode(b"\x00" * 64)
    with pytest.raises(warmstart.RejectedFile, match="checksum"):
        warmstart.decode(data[:-1])
    with pytest.raises(warmstart.RejectedFile, match="corrupt header"):
        warmstart.decode(warmstart.MAGIC + b"{not json\npayload")
    other = data.replace(torch.__version__.encode(), b"1.0.0")
    with pytest.raises(warmstart.RejectedFile, match=r"saved by torch 1\.0\.0, this is torch"):
        warmstart.decode(other)


def test_write_is_atomic_and_creates_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c.bin"
    warmstart.write_atomic(str(path), b"one")
    warmstart.write_atomic(str(path), b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(path.parent) == ["c.bin"]  # no temporary file left


def test_only_rank_zero_saves(artifacts: Callable[[], None], tmp_path: Path) -> None:
    from guardtrain.engine.host import Host

    artifacts()
    path = tmp_path / "c.bin"
    status = warmstart.load(str(path), Host(info=lambda m: None), {"backend": "inductor"})
    warmstart.save(status, Host(), rank=1)
    assert status["save"] == "rank 1: rank zero saves" and not path.exists()
    warmstart.save(status, Host(), rank=0)
    assert status["save"] == "saved" and status["saved"] == {"inductor": 1}
    assert warmstart.decode(path.read_bytes())


# -- runs ------------------------------------------------------------------------------------


def test_missing_file_logs_one_info_line_and_is_written_after_fit(
    artifacts: Callable[[], None], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cache" / "compile.bin"  # its folder does not exist yet
    artifacts()
    cb = guard(compile_cache=str(path))
    model = TinyModule()
    with caplog.at_level(logging.INFO, logger=RANK_ZERO):
        trainer = fit(model, [cb], max_epochs=1)
        trainer.validate(
            model, loaders()[1], verbose=False
        )  # a second run of the engine: no second load
    assert len(_messages(caplog, MISSING)) == 1
    s = cb.summary()["compile_cache"]
    assert s["load"] == "missing" and s["save"] == "saved"
    assert s["saved"] == {"inductor": 1}
    assert warmstart.decode(path.read_bytes())
    assert "compile cache    no file yet (cold); saved 1 artifact (inductor 1)" in (
        cb.format_summary()
    )

    # The next run loads it.
    again = guard(compile_cache=str(path))
    with caplog.at_level(logging.INFO, logger=RANK_ZERO):
        fit(TinyModule(), [again], max_epochs=1)
    loaded = again.summary()["compile_cache"]
    assert loaded["load"] == "loaded" and loaded["loaded"] == {"inductor": 1}
    assert _messages(caplog, "loaded compile cache")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_torch"])
def test_corrupt_file_warns_and_compiles_cold(
    damage: str, artifacts: Callable[[], None], tmp_path: Path
) -> None:
    path = tmp_path / "compile.bin"
    good = warmstart.encode(b"\x00" * 64)
    path.write_bytes(
        {
            "garbage": os.urandom(256),
            "truncated": good[:-10],
            "other_torch": good.replace(torch.__version__.encode(), b"0.0.1"),
        }[damage]
    )
    artifacts()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cb, _ = compare(TinyModule, lambda: guard(compile_cache=str(path)), max_epochs=2)
    assert len(_ours(record)) == 1, _ours(record)
    assert NOT_USED in _ours(record)[0]
    s = cb.summary()["compile_cache"]
    assert s["load"] == "rejected" and s["why"]
    assert s["save"] == "saved"  # replaced by a good file
    assert warmstart.decode(path.read_bytes())


def _bad_entry() -> bytes:
    """Torch's format, holding one Inductor entry that does not unpickle."""
    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager.record_artifact("inductor", "fbadentry", b"not a pickle")
        saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    return saved[0]


@pytest.mark.parametrize(
    ("payload", "why"),
    [(lambda: b"\x00" * 64, "torch could not read"), (_bad_entry, "torch could not load it")],
    ids=["unreadable", "bad_entry"],
)
def test_torch_refusing_the_payload_warns_once(
    payload: Callable[[], bytes],
    why: str,
    artifacts: Callable[[], None],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A file with a good header and checksum that torch cannot use: guardtrain's warning only."""
    path = tmp_path / "compile.bin"
    path.write_bytes(warmstart.encode(payload()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cb = guard(compile_cache=str(path))
        fit(TinyModule(), [cb], max_epochs=1)
    assert len(_ours(record)) == 1 and why in _ours(record)[0], _ours(record)
    assert not [r for r in caplog.records if r.name == "torch.compiler._cache"]
    assert cb.summary()["compile_cache"]["save"] == "empty"
    assert path.exists()  # nothing recorded: the file is left as it was


def test_a_bad_inductor_entry_is_named_before_torch_writes_it(
    artifacts: Callable[[], None],
) -> None:
    """torch 2.15 writes a bad entry without reading it (earlier versions raised): guardtrain
    unpickles the Inductor entries itself, so every torch refuses the file at load (H36)."""
    assert "'fbadentry' does not unpickle" in (warmstart.unreadable_entry(_bad_entry()) or "")
    artifacts()
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    assert warmstart.unreadable_entry(saved[0]) is None
    assert warmstart.unreadable_entry(b"\x00" * 64) is None  # not torch's format: torch decides


def test_caches_off_warns_and_saves_nothing(artifacts: Callable[[], None], tmp_path: Path) -> None:
    artifacts()
    path = tmp_path / "compile.bin"
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        pytest.warns(UserWarning, match="fx_graph_cache is off"),
    ):
        cb = guard(compile_cache=str(path))
        fit(TinyModule(), [cb], max_epochs=1)
    assert cb.summary()["compile_cache"]["load"] == "off"
    assert not path.exists()


def test_unwritable_file_warns_and_the_run_ends(
    artifacts: Callable[[], None], tmp_path: Path
) -> None:
    (tmp_path / "a_file").write_text("")
    path = tmp_path / "a_file" / "compile.bin"  # its "folder" is a file
    artifacts()
    with pytest.warns(UserWarning, match="could not save the compile cache"):
        cb = guard(compile_cache=str(path))
        fit(TinyModule(), [cb], max_epochs=1)
    assert cb.summary()["compile_cache"]["save"] == "failed"


def test_guard_tuner_saves_and_loads(
    artifacts: Callable[[], None], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "compile.bin"
    artifacts()
    model = Net()
    with (
        caplog.at_level(logging.INFO, logger="guardtrain"),
        guard_tuner(model, compile_cache=path) as tuner,
    ):
        _steps(model, tuner)
    assert len(_messages(caplog, MISSING)) == 1
    assert tuner.summary()["compile_cache"]["save"] == "saved"

    path.write_bytes(path.read_bytes()[:-3])  # damaged: the tuner warns and runs cold
    eager_model, guarded_model = Net(), Net()
    guarded_model.load_state_dict(eager_model.state_dict())
    with (
        pytest.warns(UserWarning, match=NOT_USED),
        guard_tuner(guarded_model, compile_cache=path) as tuner,
    ):
        guarded = _steps(guarded_model, tuner)
    assert guarded == _steps(eager_model, None)
    assert tuner.summary()["compile_cache"]["save"] == "saved", tuner.summary()["compile_cache"]
    with guard_tuner(Net(), compile_cache=path) as tuner:  # replaced by a good file
        pass
    assert tuner.summary()["compile_cache"]["load"] == "loaded", tuner.summary()["compile_cache"]


def test_trainer_without_compile_cache_has_no_entry() -> None:
    cb = guard()
    fit(TinyModule(), [cb], max_epochs=1)
    assert cb.summary()["compile_cache"] is None
    assert "compile cache" not in cb.format_summary()


# -- inductor, two processes -----------------------------------------------------------------

RUN = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch._dynamo.utils import counters
    sys.path.insert(0, {tests!r})
    from helpers import Net, guard_tuner

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 8, generator=g) for _ in range(6)]
    losses = []
    with guard_tuner(
        model, compile_cache={path!r}, compile_kwargs={{"backend": "inductor"}},
        warmup_steps=2, stable_steps=1, measure_lookup=False,
    ) as tuner:
        for x in batches:
            with tuner.step((x,)):
                loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    print(json.dumps({{
        "cache": tuner.summary()["compile_cache"],
        "steady": tuner.summary()["steady_steps"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "losses": losses,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }}))
    """
)


def _inductor_run(tmp_path: Path, name: str, cache_file: Path) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"))
    env.pop("GUARDTRAIN_DISABLE", None)
    code = RUN.format(tests=str(ROOT / "tests"), path=str(cache_file))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_inductor_second_process_compiles_from_the_file(tmp_path: Path) -> None:
    """Two processes, each with a fresh Inductor cache folder: the second hits every graph."""
    cache_file = tmp_path / "compile.bin"
    cold = _inductor_run(tmp_path, "cold", cache_file)
    assert cold["cache"]["load"] == "missing" and cold["cache"]["save"] == "saved"
    assert cold["cache"]["saved"].get("inductor", 0) >= 2  # forward and backward
    assert cold["miss"] >= 2 and cold["hit"] == 0

    warm = _inductor_run(tmp_path, "warm", cache_file)
    assert warm["cache"]["load"] == "loaded"
    assert warm["cache"]["loaded"] == cold["cache"]["saved"]
    assert warm["miss"] == 0 and warm["hit"] >= 2
    assert warm["cache"]["hits"]["inductor"] == warm["hit"]
    assert warm["steady"] > 0
    torch.testing.assert_close(warm["losses"], cold["losses"])
    torch.testing.assert_close(warm["weights"], cold["weights"])
