"""The one owner of the process state (``guardtrain/engine/process.py``)."""

from __future__ import annotations

import pytest
import torch

from guardtrain.compile.stances import NO_STANCE
from guardtrain.engine.process import PROCESS, stance_is_unsafe
from guardtrain.errors import GuardTrainRuntimeError


def test_settings_save_set_and_restore() -> None:
    cfg = torch._dynamo.config
    before = cfg.install_free_tensors
    plain = torch._dynamo.eval_frame._stance
    session = PROCESS.start_run("test")
    session.begin()
    session.set_config("install_free_tensors", not before)
    # The session hands out the stance values; it never sets the stance itself (H41).
    assert session.stances.plain is plain and not stance_is_unsafe()
    assert session.stances.unsafe.skip_guard_eval_unsafe
    assert session.stances.unsafe.stance == plain.stance
    session.restore()
    assert not stance_is_unsafe() and cfg.install_free_tensors is before
    torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    try:
        with pytest.raises(GuardTrainRuntimeError, match="already set when the run starts"):
            PROCESS.start_run("test").begin()
    finally:
        torch.compiler.set_stance("default")


def test_a_stance_the_user_set_is_never_replaced() -> None:
    """Under ``force_eager`` or ``fail_on_recompile`` the session has no stance to replace:
    steady calls run under the user's stance (NO_STANCE never matches torch's)."""
    for name in ("force_eager", "fail_on_recompile"):
        with torch.compiler.set_stance(name):
            session = PROCESS.start_run("test")
            session.begin()
            assert session.stances.plain is NO_STANCE and session.stances.unsafe is None
            session.restore()


def test_pause_and_resume_put_the_config_back_and_set_it_again() -> None:
    cfg = torch._dynamo.config
    before = cfg.install_free_tensors
    settings = PROCESS.start_run("test")
    settings.begin({"install_free_tensors": not before})
    assert cfg.install_free_tensors is (not before)
    assert "Dynamo's config install_free_tensors (test's run)" in PROCESS.changed()
    settings.pause()
    assert cfg.install_free_tensors is before and PROCESS.changed() == []
    settings.set_config("install_free_tensors", not before)  # remembered, set at resume
    assert cfg.install_free_tensors is before
    settings.resume()
    assert cfg.install_free_tensors is (not before)
    settings.restore()
    assert cfg.install_free_tensors is before and PROCESS.changed() == []


def test_begin_sets_only_the_values_that_differ() -> None:
    cfg = torch._dynamo.config
    settings = PROCESS.start_run("test")
    settings.begin({"install_free_tensors": cfg.install_free_tensors})
    assert settings.changed() == []
    settings.restore()


def test_a_take_over_is_listed_until_it_is_given_back() -> None:
    given: list[str] = []

    class Adapter:
        """What takes the compile over (held weakly)."""

    key = Adapter()
    PROCESS.take(key, "accelerate's dynamo plugin, taken over by a test", lambda: given.append("x"))
    assert PROCESS.changed() == ["accelerate's dynamo plugin, taken over by a test"]
    PROCESS.give_back(key)
    PROCESS.give_back(key)  # once only
    assert given == ["x"] and PROCESS.changed() == []


def test_the_unsafe_stance_is_listed() -> None:
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        assert stance_is_unsafe() and "the unsafe stance" in PROCESS.changed()
    assert PROCESS.changed() == []
