"""Every bad argument fails in the constructor, naming the argument, the value, the fix.

The table is checked against ``GuardTuneCallback`` and ``GuardTuner``; bad values given
through Hydra are in ``test_hydra.py``, bad models (refused when the run starts) in
``test_faults_models.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Any

import pytest
from helpers import DICT_TAGS_DEFAULT
from torch import nn

from guardtrain import (
    PRESETS,
    GuardTrainError,
    GuardTrainTypeError,
    GuardTrainValueError,
    GuardTuneCallback,
    GuardTuner,
)
from guardtrain.arguments import Accepts, read_fields
from guardtrain.engine.config import GuardConfig, make_config

#: Every bad constructor argument: (kwargs, error, message pattern). ``GuardTuneCallback``
#: and ``GuardTuner`` take the same keyword arguments and refuse each the same way.
BAD_ARGUMENTS: list[tuple[dict[str, Any], type[GuardTrainError], str]] = [
    # preset
    (
        {"preset": "fast"},
        GuardTrainValueError,
        r"`preset` must be one of \['auto', 'off', 'safe'.* got 'fast'",
    ),
    ({"preset": "Balanced"}, GuardTrainValueError, r"`preset` must be one of"),
    ({"preset": 3}, GuardTrainTypeError, r"`preset` must be one of"),
    # step counts
    ({"warmup_steps": -1}, GuardTrainValueError, r"`warmup_steps` must be >= 0, got -1"),
    ({"warmup_steps": 2.5}, GuardTrainTypeError, r"`warmup_steps` must be an int, got 2.5"),
    ({"warmup_steps": True}, GuardTrainTypeError, r"`warmup_steps` must be an int, got True"),
    ({"stable_steps": 0}, GuardTrainValueError, r"`stable_steps` must be >= 1, got 0"),
    ({"stable_steps": -2}, GuardTrainValueError, r"`stable_steps` must be >= 1, got -2"),
    # flags
    ({"use_stance": "yes"}, GuardTrainTypeError, r"`use_stance` must be a bool, got 'yes'"),
    ({"install_free_tensors": 1}, GuardTrainTypeError, r"`install_free_tensors` must be a bool"),
    ({"direct_dispatch": "on"}, GuardTrainTypeError, r"`direct_dispatch` must be a bool, got 'on'"),
    (
        {"preset": "turbo", "use_stance": False},
        GuardTrainValueError,
        r"`direct_dispatch=True` needs the stance, but use_stance=False \(preset 'turbo'\)",
    ),
    (
        {"recursive_dict_tags": "no"},
        GuardTrainTypeError,
        r"`recursive_dict_tags` must be a bool or None",
    ),
    (
        {"recursive_dict_tags": 1},
        GuardTrainTypeError,
        r"`recursive_dict_tags` must be a bool or None",
    ),
    ({"unsafe_drop_floor": "x"}, GuardTrainTypeError, r"`unsafe_drop_floor` must be a bool"),
    ({"log_metrics": 1}, GuardTrainTypeError, r"`log_metrics` must be a bool"),
    ({"guard_collectives": "on"}, GuardTrainTypeError, r"`guard_collectives` must be a bool"),
    # audits and verify batches
    (
        {"audit_every": 0},
        GuardTrainValueError,
        r"`audit_every` must be >= 1 \(or None to disable\), got 0",
    ),
    ({"verify_every": 1.5}, GuardTrainTypeError, r"`verify_every` must be an int or None, got 1.5"),
    ({"verify_rtol": -1.0}, GuardTrainValueError, r"`verify_rtol` must be a number >= 0, got -1.0"),
    # guard_filter
    ({"guard_filter": "nope"}, GuardTrainValueError, r"unknown filter 'nope'; known filters"),
    (
        {"guard_filter": ["skip_all_nn_modules", "nope"]},
        GuardTrainValueError,
        r"unknown filter 'nope'",
    ),
    ({"guard_filter": 42}, GuardTrainTypeError, r"`guard_filter` must be a filter name"),
    (
        {"guard_filter": ["skip_all_nn_modules", 3]},
        GuardTrainTypeError,
        r"`guard_filter` must be a filter name, a callable",
    ),
    ({"guard_filter": object()}, GuardTrainTypeError, r"`guard_filter` must be a filter name"),
    # targets
    ({"targets": 3}, GuardTrainTypeError, r"`targets` must be None, a name or a list"),
    ({"targets": b"net"}, GuardTrainTypeError, r"`targets` must be None, a name or a list"),
    ({"targets": {"net": 1}}, GuardTrainTypeError, r"`targets` must be None, a name"),
    ({"targets": []}, GuardTrainValueError, r"`targets` must hold submodule names"),
    ({"targets": ["a", 1]}, GuardTrainValueError, r"`targets` must hold submodule names"),
    # compile_kwargs
    ({"compile_kwargs": []}, GuardTrainTypeError, r"`compile_kwargs` must be a dict"),
    (
        {"compile_kwargs": {"fullgrap": True}},
        GuardTrainValueError,
        r"unknown key\(s\) \['fullgrap'\]",
    ),
    (
        {"compile_kwargs": {"mode": "fast"}},
        GuardTrainValueError,
        r"`compile_kwargs\['mode'\]` must be",
    ),
    (
        {"compile_kwargs": {"backend": "eager", "mode": "max-autotune"}},
        GuardTrainValueError,
        r"works only with backend='inductor'",
    ),
    (
        {"compile_kwargs": {"backend": "eager", "mode": "default"}},
        GuardTrainValueError,
        r"works only with backend='inductor'",
    ),
    (
        {"compile_kwargs": {"backend": "eager", "options": {"max_autotune": True}}},
        GuardTrainValueError,
        r"are inductor options, but backend='eager'",
    ),
    (
        {"compile_kwargs": {"options": ["max_autotune"]}},
        GuardTrainTypeError,
        r"`compile_kwargs\['options'\]` must be a dict",
    ),
    (
        {"compile_kwargs": {"fullgraph": "yes"}},
        GuardTrainTypeError,
        r"`compile_kwargs\['fullgraph'\]`",
    ),
    ({"compile_kwargs": {"dynamic": 1}}, GuardTrainTypeError, r"`compile_kwargs\['dynamic'\]`"),
    ({"compile_kwargs": {"backend": 5}}, GuardTrainTypeError, r"`compile_kwargs\['backend'\]`"),
    (
        {
            "guard_filter": "skip_globals",
            "compile_kwargs": {"options": {"guard_filter_fn": len}},
        },
        GuardTrainValueError,
        r"guard filter was passed twice",
    ),
]


def _bad_argument_id(row: tuple[dict[str, Any], type, str]) -> str:
    return "-".join(f"{key}={value!r}" for key, value in row[0].items())


@pytest.mark.parametrize("constructor", ["GuardTuneCallback", "GuardTuner"])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"), BAD_ARGUMENTS, ids=[_bad_argument_id(r) for r in BAD_ARGUMENTS]
)
def test_bad_arguments(
    kwargs: dict[str, Any], error: type[GuardTrainError], match: str, constructor: str
) -> None:
    """Refused in the constructor, with the error class and a message naming the argument.

    ``GuardTuner`` raises what ``GuardTuneCallback`` raises: the same class, the same message.
    """
    with pytest.raises(error, match=match) as info:
        if constructor == "GuardTuneCallback":
            GuardTuneCallback(**kwargs)
        else:
            GuardTuner(nn.Linear(2, 2), **kwargs)
    assert isinstance(info.value, GuardTrainError)
    if constructor == "GuardTuner":
        with pytest.raises(GuardTrainError) as from_callback:
            GuardTuneCallback(**kwargs)
        assert type(info.value) is type(from_callback.value)
        assert str(info.value) == str(from_callback.value)


def test_zero_warmup_steps_is_accepted() -> None:
    cb = GuardTuneCallback(warmup_steps=0)
    assert cb.settings.warmup_steps == 0


def test_mode_with_options_that_contradict_it() -> None:
    """No error: the mode is expanded into inductor options and explicit ``options`` win."""
    from guardtrain.compile import build_compile_kwargs
    from guardtrain.filters import keep_all

    cb = GuardTuneCallback(
        compile_kwargs={"mode": "max-autotune", "options": {"max_autotune": False}}
    )
    built = build_compile_kwargs(cb.compile_kwargs, keep_all)
    assert built["options"]["max_autotune"] is False
    assert "mode" not in built


@pytest.mark.skipif(
    os.environ.get("GUARDTRAIN_TURBO_EVERYWHERE", "") not in ("", "0"),
    reason="aggressive with use_stance=False; with turbo's levers that is refused (tested)",
)
def test_explicit_arguments_override_the_preset() -> None:
    cb = GuardTuneCallback(
        "aggressive", use_stance=False, warmup_steps=5, guard_filter="skip_globals"
    )
    assert cb.settings.use_stance is False
    assert cb.settings.warmup_steps == 5
    assert cb.settings.guard_filter == "skip_globals"
    assert cb.settings.install_free_tensors is PRESETS["aggressive"].install_free_tensors


def test_presets_table() -> None:
    assert list(PRESETS) == ["off", "safe", "balanced", "aggressive", "turbo"]
    assert not PRESETS["off"].use_stance and PRESETS["off"].guard_filter is None
    # Every preset leaves recursive dict tags at torch's default (H22, pytorch#181873).
    assert all(p.recursive_dict_tags is None for p in PRESETS.values())
    # `safe`: install_free_tensors only; every guard kept, never the stance.
    assert PRESETS["safe"].install_free_tensors and PRESETS["safe"].guard_filter is None
    assert not PRESETS["safe"].use_stance and PRESETS["safe"] != PRESETS["off"]
    assert PRESETS["balanced"].guard_filter == "skip_inbuilt_nn_modules"
    assert PRESETS["aggressive"].guard_filter == "skip_all_nn_modules"
    assert PRESETS["aggressive"].use_stance and PRESETS["aggressive"].install_free_tensors
    # `turbo`: aggressive plus direct dispatch, and only that.
    assert not any(p.direct_dispatch for name, p in PRESETS.items() if name != "turbo")
    assert PRESETS["turbo"] == dataclasses.replace(PRESETS["aggressive"], direct_dispatch=True)
    with pytest.raises(AttributeError):
        PRESETS["off"].use_stance = True  # type: ignore[misc]


def test_preset_fields_are_constructor_arguments() -> None:
    import dataclasses
    import inspect

    params = inspect.signature(GuardTuneCallback).parameters
    for f in dataclasses.fields(PRESETS["off"]):
        assert f.name in params


def test_import_has_no_side_effects() -> None:
    import subprocess
    import sys

    code = (
        "import sys, guardtrain; "
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules; "
        "guardtrain.GuardTuneCallback; import torch; "
        "from torch._dynamo import config as c; "
        "assert not c.install_free_tensors; "
        f"assert c.use_recursive_dict_tags_for_guards is {DICT_TAGS_DEFAULT}; "
        "assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def _hf_adapter() -> list[Any]:
    """``GuardTrainerCallback`` where transformers is installed (a dev dependency)."""
    try:
        from guardtrain.hf import GuardTrainerCallback
    except ImportError:
        return []
    return [GuardTrainerCallback]


def _shared_parameters(init: Any, own: tuple[str, ...]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(init).parameters.values() if p.name not in own]


def test_every_adapter_takes_guard_config_fields_as_its_arguments() -> None:
    """One argument list: names, annotations, defaults and kinds come from ``GuardConfig``
    (the Lightning callback, ``GuardTuner`` and the Hugging Face callback)."""
    namespace = vars(sys.modules[GuardConfig.__module__])
    expected = []
    for f in dataclasses.fields(GuardConfig):
        if not f.init or f.metadata.get("argument", True) is False:
            continue
        hint = eval(f.type, namespace) if isinstance(f.type, str) else f.type
        accepts = [m.type for m in getattr(hint, "__metadata__", ()) if isinstance(m, Accepts)]
        held = hint.__origin__ if hasattr(hint, "__metadata__") else hint  # Annotated[held, ...]
        annotation = accepts[0] if accepts else held
        kind = "POSITIONAL_OR_KEYWORD" if f.name == "preset" else "KEYWORD_ONLY"
        expected.append((f.name, annotation, f.default, kind))
    assert len(expected) == 21
    for init, own in (
        (GuardTuneCallback.__init__, ("self",)),
        (GuardTuner.__init__, ("self", "model", "fabric", "optimizers")),
        *((hf.__init__, ("self",)) for hf in _hf_adapter()),
    ):
        params = _shared_parameters(init, own)
        kinds = {p.kind for p in inspect.signature(init).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, init
        assert inspect.Parameter.VAR_POSITIONAL not in kinds, init
        got = [(p.name, p.annotation, p.default, p.kind.name) for p in params]
        assert got == expected, init.__qualname__
    tuner = inspect.signature(GuardTuner.__init__).parameters
    assert list(tuner)[:3] == ["self", "model", "preset"]
    for own in ("fabric", "optimizers"):
        assert tuner[own].kind is inspect.Parameter.KEYWORD_ONLY
        assert tuner[own].default is None


def test_every_argument_is_documented_in_every_adapter() -> None:
    """The ``Args:`` sections hold each field's docstring (made from ``GuardConfig``)."""
    source = inspect.getsource(GuardConfig)
    docs = {f.name: f.doc for f in read_fields(source, "GuardConfig") if f.argument}
    assert len(docs) == 21 and all(docs.values())
    for adapter in (GuardTuneCallback, GuardTuner, *_hf_adapter()):
        text = inspect.getdoc(adapter) or ""
        assert "{arguments}" not in text
        for name, doc in docs.items():
            first = doc.splitlines()[0]
            assert f"    {name}: {first}" in text, (adapter.__name__, name)


def test_make_config_is_guard_config() -> None:
    assert make_config("turbo", targets="net") == GuardConfig(preset="turbo", targets="net")
    with pytest.raises(TypeError, match="warmup_step"):
        make_config(warmup_step=3)
