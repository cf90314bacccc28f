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
    torch.compiler.set_stance("default")
    for key, value in saved.items():
        setattr(cfg, key, value)
    torch._dynamo.reset()
