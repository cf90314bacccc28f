"""LightningCLI: the callback's arguments on the command line, in config.yaml, and replayed.

Every test runs examples/cli.py's LightningCLI in this process (``args=[...]``).
The round trip iterates the signature of ``GuardTuneCallback.__init__``: a new
constructor argument fails here until :data:`SAMPLES` has a value for it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, get_args

import pytest
import yaml

from guardtrain import PRESETS, GuardTuneCallback
from guardtrain.presets import PRESET_NAMES, PresetName

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (guardtrain[dev])")
#: Lightning itself calls jsonargparse APIs that jsonargparse>=4.49 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")

ROOT = Path(__file__).resolve().parents[1]
CLASS_PATH = "guardtrain.GuardTuneCallback"
#: compile_cache's sample: a file in the temporary folder (the eager backend saves nothing).
CACHE_FILE = str(Path(tempfile.gettempdir()) / "guardtrain-test-cli" / "compile-cache.bin")
PARAMS = list(inspect.signature(GuardTuneCallback.__init__).parameters.values())[1:]

#: Constructor argument -> non-default values, each as (command-line text, parsed value).
SAMPLES: dict[str, list[tuple[str, Any]]] = {
    "preset": [("aggressive", "aggressive")],
    "warmup_steps": [("3", 3)],
    "stable_steps": [("2", 2)],
    "targets": [("net", "net"), ("[net]", ["net"])],
    "compile_kwargs": [
        ('{"backend": "eager", "fullgraph": true}', {"backend": "eager", "fullgraph": True})
    ],
    "guard_filter": [
        ("skip_globals", "skip_globals"),
        ("[skip_all_nn_modules, skip_globals]", ["skip_all_nn_modules", "skip_globals"]),
    ],
    "install_free_tensors": [("false", False)],
    "recursive_dict_tags": [("false", False)],
    "use_stance": [("false", False)],
    "direct_dispatch": [("true", True)],
    "unsafe_drop_floor": [("true", True)],
    "log_metrics": [("false", False)],
    "audit_every": [("null", None)],
    "verify_every": [("4", 4)],
    "verify_rtol": [("0.01", 0.01)],
    "verify_atol": [("0.001", 0.001)],
    "guard_collectives": [("true", True)],
    "compile_optimizer": [("true", True)],
    "measure_lookup": [("true", True)],
    "lookup_window": [("2", 2)],
    "compile_cache": [(CACHE_FILE, CACHE_FILE)],
}
#: Every run compiles with the eager backend (fast); the compile_kwargs sample replaces it.
BASE = {"compile_kwargs": {"backend": "eager"}}
TRAINER = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=0",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "guardtrain_example_cli", ROOT / "examples/cli.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # jsonargparse resolves the classes through their module
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when both ``args`` and pytest's own ``sys.argv`` are there."""
    monkeypatch.setattr(sys, "argv", ["cli.py"])


def _callback_args(values: dict[str, Any]) -> list[str]:
    args = [f"--trainer.callbacks+={CLASS_PATH}"]
    for name, value in values.items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True)
        args.append(f"--trainer.callbacks.{name}={text.strip()}")
    return args


def _guard(callbacks: list[Any]) -> Any:
    found = [c for c in callbacks if isinstance(c, GuardTuneCallback)]
    assert len(found) == 1, callbacks
    return found[0]


def _saved_init_args(config: Path) -> dict[str, Any]:
    text = config.read_text()
    assert "Unable to serialize" not in text, text
    entries = [
        c for c in yaml.safe_load(text)["trainer"]["callbacks"] if c["class_path"] == CLASS_PATH
    ]
    assert len(entries) == 1, text
    return entries[0]["init_args"]


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _constructor_state(callback: GuardTuneCallback) -> dict[str, Any]:
    """The attributes a fresh callback holds that compare by value (settings, targets, ...)."""
    return {k: v for k, v in vars(callback).items() if _plain(v)}


def test_preset_literal_matches_presets() -> None:
    assert get_args(PresetName) == ("auto", *PRESETS) == PRESET_NAMES


def test_help_lists_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        example.main(["fit", "--trainer.callbacks.help", CLASS_PATH])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.callbacks.preset {" + ",".join(PRESET_NAMES) + "}" in out
    assert "--trainer.callbacks.guard_filter" in out


def test_unknown_preset_is_rejected_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        example.main(["fit", *TRAINER, *_callback_args({"preset": "fast"})])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "fast" in err
    assert all(name in err for name in PRESET_NAMES), err


def test_samples_cover_the_signature() -> None:
    names = [p.name for p in PARAMS]
    missing = [n for n in names if n not in SAMPLES]
    assert not missing, (
        f"GuardTuneCallback.__init__ has argument(s) {missing} without a sample value: add "
        "(command-line text, parsed value) pairs to SAMPLES in tests/test_cli.py."
    )
    assert sorted(SAMPLES) == sorted(names), (
        f"SAMPLES names no argument: {set(SAMPLES) - set(names)}"
    )
    for p in PARAMS:
        for text, value in SAMPLES[p.name]:
            assert value != p.default, f"the sample {text!r} of {p.name!r} is its default"


@pytest.mark.parametrize(
    ("name", "index"),
    [
        pytest.param(p.name, i, id=f"{p.name}-{i}")
        for p in PARAMS
        for i in range(max(1, len(SAMPLES.get(p.name, ()))))
    ],
)
def test_every_argument_round_trips(name: str, index: int, tmp_path: Path) -> None:
    if name not in SAMPLES:
        pytest.fail(
            f"GuardTuneCallback.__init__ has a new argument {name!r} without a sample value: add "
            f"SAMPLES[{name!r}] = [(command-line text, parsed value)] in tests/test_cli.py."
        )
    text, value = SAMPLES[name][index]
    args = [*TRAINER, f"--trainer.default_root_dir={tmp_path}", *_callback_args(BASE)]
    args.append(f"--trainer.callbacks.{name}={text}")
    cli = example.main(["fit", *args])  # fits two batches and saves config.yaml
    ran = _guard(cli.trainer.callbacks)
    assert ran.summary()["preset"] == (value if name == "preset" else "auto")

    expected = {p.name: p.default for p in PARAMS} | BASE | {name: value}
    saved = _saved_init_args(tmp_path / "config.yaml")
    assert saved == expected

    replayed = cli.parser.parse_args(["fit", "--config", str(tmp_path / "config.yaml")])
    (spec,) = replayed.fit.trainer.callbacks
    assert spec.class_path == CLASS_PATH
    assert spec.init_args.as_dict() == expected
    instantiate = getattr(cli.parser, "instantiate", None) or cli.parser.instantiate_classes
    rebuilt = _guard(instantiate(replayed).fit.trainer.callbacks)
    assert _constructor_state(rebuilt) == _constructor_state(GuardTuneCallback(**expected))


def test_replayed_config_fits_the_same(tmp_path: Path) -> None:
    values = {
        "preset": "aggressive",
        "guard_filter": ["skip_all_nn_modules", "skip_globals"],
        "warmup_steps": 3,
        "stable_steps": 2,
        **BASE,
    }
    first_dir, replay_dir = tmp_path / "first", tmp_path / "replay"
    common = [t for t in TRAINER if "limit_train_batches" not in t] + [
        "--trainer.limit_train_batches=8"
    ]
    first = example.main(
        ["fit", *common, f"--trainer.default_root_dir={first_dir}", *_callback_args(values)]
    )
    replay = example.main(
        [
            "fit",
            "--config",
            str(first_dir / "config.yaml"),
            f"--trainer.default_root_dir={replay_dir}",
        ]
    )
    assert (replay_dir / "config.yaml").read_text() == (
        first_dir / "config.yaml"
    ).read_text().replace(str(first_dir), str(replay_dir))
    a, b = _guard(first.trainer.callbacks).summary(), _guard(replay.trainer.callbacks).summary()
    assert b["preset"] == "aggressive"
    assert b["levers"] == a["levers"]
    assert b["levers"]["install_free_tensors"] is True
    assert b["levers"]["use_stance"] is True
    assert b["levers"]["soundness_floor"] is True
    assert b["targets"] == ["net"]
    assert b["phase"] == a["phase"] == "steady"
    for key in ("compiles", "warmup_steps_taken", "steady_steps", "rearms"):
        assert b[key] == a[key], key
    assert b["steady_steps"] > 0
