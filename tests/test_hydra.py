"""The Hydra ``guard`` config group, its search path plugin, and examples/train.py.

Most tests compose in this process through Hydra's compose API. Tests that
start a Python process (``--info searchpath``, apps written into ``tmp_path``)
take a few seconds each, for importing torch; the ones that train the example
or build a wheel are marked ``slow`` (and the DDP run ``distributed``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("hydra", reason="the Hydra integration needs hydra-core (guardtrain[hydra])")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
CONF_DIR = ROOT / "conf"

# An editable install made before hydra_plugins/ existed does not map it; the
# source tree then provides the plugin (to this process and to subprocesses).
if importlib.util.find_spec("hydra_plugins.guardtrain_searchpath") is None:
    sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir, initialize_config_module  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.errors import (  # noqa: E402
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
)
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

import guardtrain  # noqa: E402
from guardtrain import PRESETS, GuardTuneCallback  # noqa: E402
from guardtrain.errors import GuardTrainValueError  # noqa: E402
from guardtrain.presets import PRESET_NAMES as ALL_PRESETS  # noqa: E402
from guardtrain.presets import get_preset  # noqa: E402
from hydra_plugins.guardtrain_searchpath import searchpath as plugin  # noqa: E402

PRESET_NAMES = sorted(ALL_PRESETS)  # auto, the default, and PRESETS

import hydra  # noqa: E402

_HYDRA = tuple(int(part) for part in hydra.__version__.split(".")[:2])
#: Apps that start through ``@hydra.main``: every Hydra release up to 1.3 fails there on
#: Python 3.14, before any guardtrain code runs (docs/versions.md).
HYDRA_MAIN = pytest.mark.xfail(
    sys.version_info >= (3, 14) and _HYDRA < (1, 4),
    reason="Hydra <= 1.3's @hydra.main fails on Python 3.14: argparse refuses its lazy "
    "--shell-completion help (facebookresearch/hydra#3121)",
    strict=True,
)
#: Keys Hydra reads itself; every other key of an option is a constructor argument.
HYDRA_KEYS = {"_target_", "_convert_", "_recursive_", "_partial_", "_args_"}
#: The off and aggressive runs must agree this closely. Bitwise equality is
#: expected (eager backend, deterministic, same seed); stale dropout or
#: BatchNorm moves the loss by orders of magnitude more
#: (test_tolerance_catches_stale_dropout_and_batchnorm).
VAL_LOSS_TOL = 1e-6
SUBPROCESS_TIMEOUT = 300


def _constructor_args() -> dict[str, inspect.Parameter]:
    params = inspect.signature(GuardTuneCallback.__init__).parameters
    return {n: p for n, p in params.items() if n != "self"}


def _preset_values(name: str) -> dict[str, Any]:
    return dataclasses.asdict(get_preset(name))


@contextmanager
def _guardtrain_conf() -> Iterator[None]:
    """Hydra with ``guardtrain.conf`` as the primary config module (no app config)."""
    with initialize_config_module(version_base="1.3", config_module="guardtrain.conf"):
        yield


@contextmanager
def _example_conf() -> Iterator[None]:
    """Hydra with the example's ``conf/``: the guard group comes from the plugin only."""
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        yield


def _compose_guard(*overrides: str) -> DictConfig:
    with _guardtrain_conf():
        return compose(overrides=list(overrides))


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guardtrain_example_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _option_files() -> dict[str, Path]:
    group = importlib.resources.files("guardtrain.conf").joinpath("guard")
    return {
        f.name.removesuffix(".yaml"): Path(str(f))
        for f in group.iterdir()
        if f.name.endswith(".yaml")
    }


def _bare_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GUARDTRAIN_DISABLE", "PYTHONPATH")}
    env["HYDRA_FULL_ERROR"] = "1"
    return env


def _env() -> dict[str, str]:
    """Environment for a child process: the installed package and plugin, nothing from PYTHONPATH."""
    return _bare_env()


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = SUBPROCESS_TIMEOUT
) -> str:
    proc = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


# -- the config group ----------------------------------------------------------------------


def test_group_options_are_exactly_the_presets() -> None:
    assert set(_option_files()) == set(ALL_PRESETS)
    with _guardtrain_conf():
        loader = GlobalHydra.instance().config_loader()
        assert loader.get_group_options("guard") == PRESET_NAMES
    with _example_conf():  # through the plugin's search path, next to the app's groups
        loader = GlobalHydra.instance().config_loader()
        assert loader.get_group_options("guard") == PRESET_NAMES
        assert loader.get_group_options("trainer") == ["cpu", "ddp"]


def test_wrong_option_lists_the_valid_ones() -> None:
    with _example_conf(), pytest.raises(MissingConfigException) as info:
        compose(config_name="train", overrides=["+guard=agressive"])
    message = str(info.value)
    assert "Could not find 'guard/agressive'" in message
    listed = re.search(r"Available options in 'guard':\n((?:\t.*\n?)+)", message)
    assert listed is not None, message
    assert listed.group(1).split() == PRESET_NAMES


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_option_file_every_key_commented(name: str) -> None:
    lines = _option_files()[name].read_text().splitlines()
    assert lines[0] == "# @package callbacks.guard_tune"
    code = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    uncommented = [line for line in code if " # " not in line]
    assert not uncommented, f"{name}.yaml: lines without a comment: {uncommented}"
    assert all(len(line) <= 100 for line in lines)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_option_keys_are_constructor_arguments(name: str) -> None:
    raw = OmegaConf.load(_option_files()[name])
    keys = set(raw) - {"defaults"}
    args = set(_constructor_args())
    assert raw._target_ == "guardtrain.GuardTuneCallback"
    assert keys - HYDRA_KEYS == args, (
        f"{name}.yaml and GuardTuneCallback.__init__ differ: only in YAML "
        f"{sorted(keys - HYDRA_KEYS - args)}, only in the signature {sorted(args - keys)}"
    )
    # The YAML holds the preset's values, not only its name.
    assert {k: raw[k] for k in _preset_values(name)} == _preset_values(name)
    assert raw.preset == name


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_option_composes_and_instantiates_to_the_python_preset(name: str) -> None:
    cfg = _compose_guard(f"+guard={name}")
    assert list(cfg) == ["callbacks"] and list(cfg.callbacks) == ["guard_tune"]
    node = cfg.callbacks.guard_tune
    assert node._target_ == "guardtrain.GuardTuneCallback"
    assert OmegaConf.get_type(node) is plugin.GuardTuneConf  # the schema was applied
    assert {k: node[k] for k in _preset_values(name)} == _preset_values(name)

    callback = instantiate(node)
    assert type(callback) is GuardTuneCallback
    assert callback.preset == name
    assert callback.settings == get_preset(name)
    assert callback.compile_kwargs == {"backend": "inductor"}
    assert type(callback.compile_kwargs) is dict
    assert callback.targets is None
    assert callback.unsafe_drop_floor is False
    assert callback.log_metrics is True


def test_schema_fields_and_defaults_equal_the_constructor() -> None:
    fields = {f.name: f for f in dataclasses.fields(plugin.GuardTuneConf)}
    args = _constructor_args()
    assert set(fields) - HYDRA_KEYS == set(args)
    for name, param in args.items():
        assert fields[name].default == param.default, name
    assert fields["_target_"].default == "guardtrain.GuardTuneCallback"


def test_command_line_override_changes_one_value() -> None:
    cfg = _compose_guard("+guard=balanced", "callbacks.guard_tune.warmup_steps=50")
    callback = instantiate(cfg.callbacks.guard_tune)
    assert callback.settings == dataclasses.replace(PRESETS["balanced"], warmup_steps=50)


def test_package_override_moves_the_whole_node() -> None:
    cfg = _compose_guard("+guard@callbacks.my_guard=safe", "callbacks.my_guard.stable_steps=3")
    assert list(cfg.callbacks) == ["my_guard"]
    node = cfg.callbacks.my_guard
    assert OmegaConf.get_type(node) is plugin.GuardTuneConf
    callback = instantiate(node)
    assert callback.preset == "safe"
    assert callback.settings == dataclasses.replace(PRESETS["safe"], stable_steps=3)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("callbacks.guard_tune.warmup_step=5", ["Key 'warmup_step' not in 'GuardTuneConf'"]),
        ("callbacks.guard_tune.warmup_steps=many", ["warmup_steps", "'many'", "Integer"]),
        ("callbacks.guard_tune.use_stance=maybe", ["use_stance", "'maybe'", "not a valid bool"]),
    ],
)
def test_command_line_typos_and_wrong_types_fail_at_composition(
    override: str, expected: list[str]
) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose_guard("+guard=aggressive", override)
    message = f"{info.value} {info.value.__cause__}"
    for text in expected:
        assert text in message, message


def test_schema_rejects_a_misspelt_key_in_a_config_file(tmp_path: Path) -> None:
    """A user's config that sets a key the callback does not have fails at composition."""
    (tmp_path / "app.yaml").write_text(
        "defaults:\n  - guard: aggressive\n  - _self_\n\n"
        "callbacks:\n  guard_tune:\n    warmup_step: 5\n"
    )
    with initialize_config_dir(version_base="1.3", config_dir=str(tmp_path)):
        with pytest.raises(ConfigCompositionException) as info:
            compose(config_name="app")
        (tmp_path / "app.yaml").write_text(
            (tmp_path / "app.yaml").read_text().replace("warmup_step:", "warmup_steps:")
        )
        fixed = compose(config_name="app")
    message = str(info.value)
    assert "Key 'warmup_step' not in 'GuardTuneConf'" in message, message
    assert "full_key: callbacks.guard_tune.warmup_step" in message
    assert instantiate(fixed.callbacks.guard_tune).settings.warmup_steps == 5


@pytest.mark.parametrize(
    ("override", "cause", "expected"),
    [
        (
            "callbacks.guard_tune.warmup_steps=-1",
            GuardTrainValueError,
            ["`warmup_steps` must be >= 0, got -1."],
        ),
        (
            "callbacks.guard_tune.guard_filter=nope",
            GuardTrainValueError,
            ["unknown filter 'nope'", "skip_all_nn_modules"],
        ),
        (
            "+callbacks.guard_tune.compile_kwargs.modes=max-autotune",
            GuardTrainValueError,
            ["unknown key(s) ['modes']"],
        ),
        (  # `+` adds a key past the schema; the constructor still refuses it
            "+callbacks.guard_tune.warmup_step=5",
            TypeError,
            ["unexpected keyword argument 'warmup_step'"],
        ),
    ],
)
def test_bad_values_fail_at_instantiation_with_the_callbacks_message(
    override: str, cause: type[BaseException], expected: list[str]
) -> None:
    cfg = _compose_guard("+guard=aggressive", override)  # composes: the types are right
    with pytest.raises(InstantiationException) as info:
        instantiate(cfg.callbacks.guard_tune)
    assert isinstance(info.value.__cause__, cause)
    assert "guardtrain.callback.GuardTuneCallback" in str(info.value)
    for text in expected:
        assert text in str(info.value), str(info.value)


# -- the example's configs (in this process) ---------------------------------------------------


def test_example_config_instantiates_the_callbacks_node() -> None:
    example = _load_example()
    with _example_conf():
        cfg = compose(
            config_name="train",
            overrides=["+guard=aggressive", "callbacks.guard_tune.compile_kwargs.backend=eager"],
        )
        plain = compose(config_name="train")
    assert list(cfg.callbacks) == ["model_summary", "guard_tune"]
    assert list(plain.callbacks) == ["model_summary"]
    callbacks = example.instantiate_callbacks(cfg.callbacks)
    assert [type(c).__name__ for c in callbacks] == ["ModelSummary", "GuardTuneCallback"]
    assert callbacks[1].settings == PRESETS["aggressive"]
    assert callbacks[1].compile_kwargs == {"backend": "eager"}
    # The validation loop ends with a short batch; training batches keep one shape.
    assert cfg.data.n_val % cfg.data.batch_size != 0
    assert cfg.trainer.deterministic is True


def test_example_refuses_guard_as_a_plain_value() -> None:
    """Where the plugin is missing, `+guard=aggressive` becomes a string; the app stops."""
    example = _load_example()
    with pytest.raises(ValueError, match=r"hydra\.searchpath=\[pkg://guardtrain\.conf\]"):
        example.check_guard_group(OmegaConf.create({"guard": "aggressive"}))
    example.check_guard_group(OmegaConf.create({"callbacks": {}}))


def test_tolerance_catches_stale_dropout_and_batchnorm() -> None:
    """A val loss computed with train-mode dropout or BatchNorm is far outside VAL_LOSS_TOL."""
    import lightning as L
    import torch
    from torch.nn import functional as F

    example = _load_example()
    with _example_conf():
        cfg = compose(config_name="train")
    data = example.BlobsDataModule(**cfg.data)
    data.setup("fit")
    L.seed_everything(cfg.seed)
    model = example.LitClassifier(cfg.data.n_features, cfg.data.n_classes, **cfg.model)
    x, y = data.val_set.tensors

    def val_loss(dropout_training: bool, batchnorm_training: bool) -> float:
        model.eval()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.train(dropout_training)
            if isinstance(m, torch.nn.BatchNorm1d):
                m.train(batchnorm_training)
        with torch.no_grad():
            return float(F.cross_entropy(model(x), y))

    state = {k: v.clone() for k, v in model.state_dict().items()}
    clean = val_loss(False, False)
    stale_dropout = val_loss(True, False)
    stale_batchnorm = val_loss(False, True)
    model.load_state_dict(state)
    assert val_loss(False, False) == clean
    assert abs(stale_dropout - clean) > 1000 * VAL_LOSS_TOL
    assert abs(stale_batchnorm - clean) > 1000 * VAL_LOSS_TOL


# -- the plugin, in child processes ---------------------------------------------------------


def test_plugin_is_discovered_and_imports_nothing_heavy(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import json, sys
        from hydra.core.plugins import Plugins
        from hydra.plugins.search_path_plugin import SearchPathPlugin
        names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
        heavy = [m for m in ("torch", "lightning", "guardtrain") if m in sys.modules]
        print(json.dumps({"plugins": names, "heavy": heavy}))
        """
    )
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env=_env())
    result = json.loads(out.strip().splitlines()[-1])
    assert "GuardTrainSearchPathPlugin" in result["plugins"]
    assert result["heavy"] == []


@HYDRA_MAIN
def test_example_info_searchpath_lists_the_package(tmp_path: Path) -> None:
    out = _run([sys.executable, str(EXAMPLE), "--info", "searchpath"], cwd=tmp_path, env=_env())
    assert re.search(r"^\| guardtrain +\| pkg://guardtrain\.conf +\|$", out, re.M), out
    assert re.search(rf"^\| main +\| file://{re.escape(str(CONF_DIR))} +\|$", out, re.M), out


OUTSIDE_APP = """
import dataclasses, json

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base="1.3", config_path=None)
def main(cfg):
    import guardtrain
    from hydra_plugins.guardtrain_searchpath import searchpath

    callback = hydra.utils.instantiate(cfg.callbacks.guard_tune)
    sources = HydraConfig.get().runtime.config_sources
    print("RESULT " + json.dumps({
        "guardtrain_file": guardtrain.__file__,
        "plugin_file": searchpath.__file__,
        "type": type(callback).__module__ + "." + type(callback).__qualname__,
        "preset": callback.preset,
        "settings": dataclasses.asdict(callback.settings),
        "expected": dataclasses.asdict(guardtrain.PRESETS["aggressive"]),
        "sources": [[s.provider, s.schema + "://" + s.path] for s in sources],
    }))


if __name__ == "__main__":
    main()
"""


def _run_outside_app(python: str, app_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    app_dir.mkdir(parents=True, exist_ok=True)
    (app_dir / "app.py").write_text(OUTSIDE_APP)
    out = _run(
        [python, "app.py", "+guard=aggressive", f"hydra.run.dir={app_dir / 'run'}"],
        cwd=app_dir,
        env=env,
    )
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["type"] == "guardtrain.callback.GuardTuneCallback"
    assert result["preset"] == "aggressive"
    assert result["settings"] == result["expected"]
    assert ["guardtrain", "pkg://guardtrain.conf"] in result["sources"]
    return result


@HYDRA_MAIN
def test_app_outside_the_repository_composes_the_group(tmp_path: Path) -> None:
    result = _run_outside_app(sys.executable, tmp_path / "app", _env())
    assert result["settings"] == _preset_values("aggressive")
    assert Path(result["guardtrain_file"]).resolve() == Path(guardtrain.__file__).resolve()


NO_PLUGINS_APP = """
import dataclasses, json, sys, types

# Hide every Hydra plugin: the group can come only from hydra.searchpath.
sys.modules["hydra_plugins"] = types.ModuleType("hydra_plugins")
sys.modules["hydra_plugins"].__path__ = []

import hydra
from omegaconf import OmegaConf


@hydra.main(version_base="1.3", config_path=None)
def main(cfg):
    if "callbacks" not in cfg:
        print("RESULT " + json.dumps(OmegaConf.to_container(cfg)))
        return
    node = cfg.callbacks.guard_tune
    callback = hydra.utils.instantiate(node)
    print("RESULT " + json.dumps({
        "schema": OmegaConf.get_type(node).__name__,
        "preset": callback.preset,
        "settings": dataclasses.asdict(callback.settings),
    }))


if __name__ == "__main__":
    main()
"""


@HYDRA_MAIN
def test_manual_searchpath_works_without_the_plugin(tmp_path: Path) -> None:
    """The documented alternative: ``hydra.searchpath=[pkg://guardtrain.conf]``."""
    (tmp_path / "app.py").write_text(NO_PLUGINS_APP)
    run = ["app.py", "+guard=aggressive", f"hydra.run.dir={tmp_path / 'run'}"]
    # Without the group, Hydra reads `+guard=aggressive` as "add the value"; no error.
    out = _run([sys.executable, *run], cwd=tmp_path, env=_env())
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) == {"guard": "aggressive"}

    out = _run(
        [sys.executable, *run, "hydra.searchpath=[pkg://guardtrain.conf]"],
        cwd=tmp_path,
        env=_env(),
    )
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    # No plugin, no schema in the ConfigStore: the `optional` default skips it.
    assert result == {
        "schema": "dict",
        "preset": "aggressive",
        "settings": _preset_values("aggressive"),
    }


UNRELATED_APP = """
import sys

import hydra


@hydra.main(version_base="1.3", config_path=None)
def main(cfg):
    print("HEAVY", sorted(m for m in ("torch", "lightning") if m in sys.modules))


if __name__ == "__main__":
    main()
"""


@HYDRA_MAIN
def test_unrelated_hydra_app_does_not_import_torch(tmp_path: Path) -> None:
    """Hydra imports ``guardtrain`` (presets, filters) to read the group; torch and Lightning stay out."""
    (tmp_path / "app.py").write_text(UNRELATED_APP)
    out = _run(
        [sys.executable, "app.py", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_env()
    )
    assert "HEAVY []" in out, out


# -- the example, end to end ------------------------------------------------------------------


def _run_example(cwd: Path, *overrides: str) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    return _run(
        [sys.executable, str(EXAMPLE), *overrides, f"hydra.run.dir={cwd / 'run'}"],
        cwd=cwd,
        env=_env(),
    )


def _final_metric(out: str, key: str) -> float:
    found = re.findall(rf"final {re.escape(key)}=(\S+)", out)
    assert len(found) == 1, out[-4000:]
    return float(found[0])


def _summary(out: str) -> dict[str, str]:
    start = out.find("guardtrain summary")
    assert start >= 0, f"no guardtrain summary in the output:\n{out[-4000:]}"
    rows = {}
    for line in out[start:].splitlines()[1:]:
        match = re.match(r"^  (\S[\w -]*?)\s{2,}(.*)$", line)
        if not match:
            break
        rows[match.group(1)] = match.group(2)
    return rows


def _run_off_and_aggressive(tmp_path: Path, *overrides: str) -> dict[str, str]:
    """The example with ``+guard=off`` and ``+guard=aggressive``: eager backend, short warm-up."""
    common = [
        *overrides,
        "callbacks.guard_tune.compile_kwargs.backend=eager",
        "callbacks.guard_tune.warmup_steps=3",
        "callbacks.guard_tune.stable_steps=2",
    ]
    return {
        name: _run_example(tmp_path / name, f"+guard={name}", *common)
        for name in ("off", "aggressive")
    }


@HYDRA_MAIN
@pytest.mark.slow
def test_example_off_and_aggressive_give_the_same_validation_metric(tmp_path: Path) -> None:
    outs = _run_off_and_aggressive(tmp_path)
    summaries = {name: _summary(out) for name, out in outs.items()}

    aggressive = summaries["aggressive"]
    assert aggressive["preset"] == "aggressive"
    # Both loops reached the steady state: the last validation pass ran in the stance.
    assert aggressive["phase"].startswith("steady  (loops: train=steady, validate=steady")
    assert int(aggressive["steady steps"]) > 0
    assert int(aggressive["warm-up steps"]) >= 3
    assert aggressive["targets"] == "net"
    # The bottom line: the steady step, and from counters what the stance skipped in it
    # (the profiled saving is measure_lookup's, off by default).
    step = re.search(r"step \(steady\)\s+([\d.]+) ms median of (\d+)", outs["aggressive"])
    assert step is not None, outs["aggressive"][-3000:]
    assert float(step.group(1)) > 0 and int(step.group(2)) >= 2, step.group(0)
    counted = re.search(
        r"steady calls: (\d+) with full guards, the others under the stance; "
        r"a call with full guards evaluates (\d+) guards",
        outs["aggressive"],
    )
    assert counted is not None, outs["aggressive"][-3000:]
    assert int(counted.group(2)) > 0, counted.group(0)
    assert summaries["off"]["preset"] == "off"
    assert summaries["off"]["phase"].startswith("off")
    assert int(summaries["off"]["steady steps"]) == 0
    for summary in summaries.values():
        # every preset compiles: "3 frames, 3 graphs by Dynamo's count (in the whole
        # process); 0.6 s compiling" (frame compiles, Dynamo's graphs, torch's seconds)
        compiles = re.match(
            r"(\d+) frames, (\d+) graphs by Dynamo's count \(in the whole process\)"
            r"(; [\d.]+ s compiling)?$",
            summary["compiles"],
        )
        assert compiles is not None and int(compiles.group(1)) >= 1, summary["compiles"]
        assert int(compiles.group(2)) >= 1, summary["compiles"]

    for key in ("val/loss", "val/acc"):
        off, aggr = (_final_metric(outs[n], key) for n in ("off", "aggressive"))
        assert abs(off - aggr) <= VAL_LOSS_TOL, f"{key}: off={off!r} aggressive={aggr!r}"
    assert 0.0 < _final_metric(outs["off"], "val/loss") < 1.0


@HYDRA_MAIN
@pytest.mark.slow
@pytest.mark.distributed
def test_example_ddp_reaches_steady_state_and_matches_off(tmp_path: Path) -> None:
    """trainer=ddp: two CPU processes; the stance is entered on every rank together."""
    outs = _run_off_and_aggressive(tmp_path, "trainer=ddp")
    aggressive = _summary(outs["aggressive"])
    assert aggressive["phase"].startswith("steady  (loops: train=steady, validate=steady")
    assert int(aggressive["steady steps"]) > 0
    assert outs["aggressive"].count("guardtrain summary") == 1  # rank zero only
    off, aggr = (_final_metric(outs[n], "val/loss") for n in ("off", "aggressive"))
    assert abs(off - aggr) <= VAL_LOSS_TOL, f"off={off!r} aggressive={aggr!r}"


# -- a built wheel in a fresh virtual environment ----------------------------------------------

_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".venvs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "outputs",
    "multirun",
    "lightning_logs",
)


@HYDRA_MAIN
@pytest.mark.slow
def test_wheel_in_a_fresh_venv_provides_group_and_plugin(tmp_path: Path) -> None:
    # Build from a copy: no stale build/ of the checkout can put files into the wheel.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    dist = tmp_path / "dist"
    bare = _bare_env()
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            str(src),
        ],
        cwd=tmp_path,
        env=bare,
    )
    (wheel,) = dist.glob("guardtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in PRESET_NAMES:
        assert f"guardtrain/conf/guard/{name}.yaml" in names
    assert "guardtrain/conf/__init__.py" in names
    assert "hydra_plugins/guardtrain_searchpath/searchpath.py" in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package

    # A venv without pip; its site-packages gets the wheel, and a .pth line makes
    # this environment's packages (torch, lightning, hydra) importable after it.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=bare)
    python = str(venv / "bin" / "python")
    purelib = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp_path,
            env=bare,
        ).strip()
    )
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (purelib / "_guardtrain_test_deps.pth").write_text("\n".join(deps) + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(purelib),
            str(wheel),
        ],
        cwd=tmp_path,
        env=bare,
    )

    result = _run_outside_app(python, tmp_path / "app", bare)
    assert Path(result["guardtrain_file"]).parent == purelib / "guardtrain"
    assert Path(result["plugin_file"]).parent == purelib / "hydra_plugins" / "guardtrain_searchpath"
    assert not str(result["guardtrain_file"]).startswith(str(ROOT))
