"""Fixtures and test-session configuration only; the shared helpers are in ``helpers.py``."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)


TURBO_EVERYWHERE_ENV = "GUARDTRAIN_TURBO_EVERYWHERE"
_DETERMINISTIC = (
    torch.are_deterministic_algorithms_enabled(),
    torch.is_deterministic_algorithms_warn_only_enabled(),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--turbo-everywhere",
        action="store_true",
        help="run every test that asks for `aggressive` with turbo's levers instead (the "
        f"full turbo set; also {TURBO_EVERYWHERE_ENV}=1, which subprocess runs inherit)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--turbo-everywhere"):
        os.environ[TURBO_EVERYWHERE_ENV] = "1"
    if os.environ.get(TURBO_EVERYWHERE_ENV, "") not in ("", "0"):
        from helpers import turbo_everywhere

        turbo_everywhere()


@pytest.fixture(autouse=True)
def _clean_dynamo():
    """Every test starts and ends with fresh Dynamo caches and the default stance."""
    torch._dynamo.reset()
    cfg = torch._dynamo.config
    saved = {
        "install_free_tensors": cfg.install_free_tensors,
        "use_recursive_dict_tags_for_guards": cfg.use_recursive_dict_tags_for_guards,
    }
    yield
    # A CompiledTarget a test made by hand stays installed (and watched) until it is
    # uninstalled: put every one back, so that the change tracking's wrappers go (H33).
    from guardtrain.compile import watch

    for target, *_ in list(watch._targets.values()):
        uninstall = getattr(target, "uninstall", None)
        if uninstall is not None:
            uninstall()
        else:
            watch.unwatch(target)
    # Trainer(deterministic=True) sets this process-wide, also from a module-scoped
    # fixture: every test ends with the session's starting value.
    torch.use_deterministic_algorithms(_DETERMINISTIC[0], warn_only=_DETERMINISTIC[1])
    torch.compiler.set_stance("default")
    for key, value in saved.items():
        setattr(cfg, key, value)
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _put_back_accelerate_env():
    """``TrainingArguments(torch_compile=True)`` writes ``ACCELERATE_DYNAMO_*`` into
    ``os.environ`` and never removes them (transformers 4.x): put them back after each
    test, so that a later test's eager run is not compiled by accelerate."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_DYNAMO_")}
    yield
    for key in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
        del os.environ[key]
    os.environ.update(saved)
