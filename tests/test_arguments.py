"""Every bad argument fails in the constructor, naming the argument, the value, the fix."""

from __future__ import annotations

from typing import Any

import pytest

from guardtrain import PRESETS, GuardTrainError, GuardTuneCallback


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"preset": "fast"}, ValueError, r"`preset` must be one of \['off', 'safe'.* got 'fast'"),
        ({"preset": 3}, TypeError, r"`preset` must be one of"),
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be >= 0, got -1"),
        ({"warmup_steps": 2.5}, TypeError, r"`warmup_steps` must be an int, got 2.5"),
        ({"stable_steps": 0}, ValueError, r"`stable_steps` must be >= 1, got 0"),
        ({"use_stance": "yes"}, TypeError, r"`use_stance` must be a bool, got 'yes'"),
        ({"install_free_tensors": 1}, TypeError, r"`install_free_tensors` must be a bool"),
        ({"recursive_dict_tags": "no"}, TypeError, r"`recursive_dict_tags` must be a bool or None"),
        ({"recursive_dict_tags": 1}, TypeError, r"`recursive_dict_tags` must be a bool or None"),
        ({"guard_filter": "nope"}, ValueError, r"unknown filter 'nope'; known filters"),
        ({"guard_filter": 42}, TypeError, r"`guard_filter` must be a filter name"),
        ({"unsafe_drop_floor": "x"}, TypeError, r"`unsafe_drop_floor` must be a bool"),
        ({"targets": 3}, TypeError, r"`targets` must be None, a name or a list"),
        ({"targets": []}, ValueError, r"`targets` must hold submodule names"),
        ({"targets": ["a", 1]}, ValueError, r"`targets` must hold submodule names"),
        ({"compile_kwargs": []}, TypeError, r"`compile_kwargs` must be a dict"),
        ({"compile_kwargs": {"fullgrap": True}}, ValueError, r"unknown key\(s\) \['fullgrap'\]"),
        ({"compile_kwargs": {"mode": "fast"}}, ValueError, r"`compile_kwargs\['mode'\]` must be"),
        (
            {"compile_kwargs": {"backend": "eager", "mode": "max-autotune"}},
            ValueError,
            r"works only with backend='inductor'",
        ),
        (
            {"compile_kwargs": {"backend": "eager", "options": {"max_autotune": True}}},
            ValueError,
            r"are inductor options, but backend='eager'",
        ),
        ({"compile_kwargs": {"fullgraph": "yes"}}, TypeError, r"`compile_kwargs\['fullgraph'\]`"),
        ({"compile_kwargs": {"dynamic": 1}}, TypeError, r"`compile_kwargs\['dynamic'\]`"),
        ({"compile_kwargs": {"backend": 5}}, TypeError, r"`compile_kwargs\['backend'\]`"),
        (
            {
                "guard_filter": "skip_globals",
                "compile_kwargs": {"options": {"guard_filter_fn": len}},
            },
            ValueError,
            r"guard filter was passed twice",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        GuardTuneCallback(**kwargs)
    assert isinstance(info.value, GuardTrainError)


def test_explicit_arguments_override_the_preset() -> None:
    cb = GuardTuneCallback(
        "aggressive", use_stance=False, warmup_steps=5, guard_filter="skip_globals"
    )
    assert cb.settings.use_stance is False
    assert cb.settings.warmup_steps == 5
    assert cb.settings.guard_filter == "skip_globals"
    assert cb.settings.install_free_tensors is PRESETS["aggressive"].install_free_tensors


def test_presets_table() -> None:
    assert list(PRESETS) == ["off", "safe", "balanced", "aggressive"]
    assert not PRESETS["off"].use_stance and PRESETS["off"].guard_filter is None
    # Every preset leaves recursive dict tags at torch's default (H22, pytorch#181873).
    assert all(p.recursive_dict_tags is None for p in PRESETS.values())
    # `safe`: install_free_tensors only; every guard kept, never the stance.
    assert PRESETS["safe"].install_free_tensors and PRESETS["safe"].guard_filter is None
    assert not PRESETS["safe"].use_stance and PRESETS["safe"] != PRESETS["off"]
    assert PRESETS["balanced"].guard_filter == "skip_inbuilt_nn_modules"
    assert PRESETS["aggressive"].guard_filter == "skip_all_nn_modules"
    assert PRESETS["aggressive"].use_stance and PRESETS["aggressive"].install_free_tensors
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
        "assert not c.install_free_tensors and not c.use_recursive_dict_tags_for_guards; "
        "assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
