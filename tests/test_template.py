"""The lightning-hydra-template's pattern with ``+guard=aggressive``: checkpoints every epoch.

The template's LightningModule takes its network as an argument and calls
``self.save_hyperparameters(logger=False)``, so the ``net`` object is pickled
into every checkpoint's ``hyper_parameters``. Its ``setup("fit")`` runs
``self.net = torch.compile(self.net)`` when ``model.compile=true``.

``tests/template_app.py`` and ``tests/template_conf/`` rebuild that pattern (a
``model.net`` ``_target_`` node, ``ModelCheckpoint`` with ``every_n_epochs: 1``
and ``save_last: true``, generated data with a short last validation batch).
``run()`` composes it in this process with Hydra's compose API, as the
template's ``train.py`` would with ``python train.py <overrides>``.

What is checked: the run completes (the first checkpoint used to fail with
``PicklingError: Can't pickle <function SimpleDenseNet.forward ...>: it's not
the same object``), every epoch's checkpoint exists and loads with
``load_from_checkpoint(path, weights_only=False)`` into a plain network that
computes what the checkpoint's weights compute in eager mode, and ``val/loss``
equals the run without guardtrain (bitwise with the eager backend).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
import warnings
from pathlib import Path

import pytest

pytest.importorskip("hydra", reason="the Hydra integration needs hydra-core (guardtrain[hydra])")

import lightning as L
import torch
from helpers import assert_restored
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig
from template_app import SimpleDenseNet, TemplateLitModule
from torch import nn

from guardtrain import GuardTuneCallback

CONF_DIR = Path(__file__).resolve().parent / "template_conf"
#: Without the plugin (an editable install older than hydra_plugins/), the group
#: comes from the documented override.
PLUGIN_FOUND = importlib.util.find_spec("hydra_plugins.guardtrain_searchpath") is not None
#: The aggressive option with the eager backend and a short warm-up (8 batches an epoch).
AGGRESSIVE_EAGER = (
    "+guard=aggressive",
    "callbacks.guard_tune.compile_kwargs.backend=eager",
    "callbacks.guard_tune.warmup_steps=3",
    "callbacks.guard_tune.stable_steps=2",
)
#: One file per epoch (``filename: epoch_{epoch:03d}``, ``every_n_epochs: 1``) and last.ckpt.
EPOCH_FILES = ["epoch_000.ckpt", "epoch_001.ckpt", "epoch_002.ckpt"]
CKPT_FILES = sorted([*EPOCH_FILES, "last.ckpt"])
TOOK_OVER = "took over"

pytestmark = pytest.mark.filterwarnings(
    # The template's own save_hyperparameters(net) warning; it is what this file reproduces.
    "ignore:Attribute 'net' is an instance of `nn.Module`:UserWarning",
)


@dataclasses.dataclass
class Run:
    cfg: DictConfig
    model: TemplateLitModule
    trainer: L.Trainer
    val_loss: float
    checkpoints: dict[str, Path]  # file name -> path
    warnings: list[str]

    @property
    def guard(self) -> GuardTuneCallback | None:
        found = [c for c in self.trainer.callbacks if isinstance(c, GuardTuneCallback)]
        assert len(found) <= 1
        return found[0] if found else None


def run(
    overrides: list[str] | tuple[str, ...], tmp_path: Path, seen: list[str] | None = None
) -> Run:
    """Compose tests/template_conf with ``overrides``, instantiate, fit 3 epochs on the CPU.

    Warning messages raised during ``fit`` are appended to ``seen`` (also when fit raises).
    """
    overrides = [*overrides, f"paths.output_dir='{tmp_path}'"]
    if not PLUGIN_FOUND:
        overrides.append("hydra.searchpath=[pkg://guardtrain.conf]")
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="train", overrides=overrides)
    # `+guard=...` read as a plain value would silently run without the callback.
    assert "guard" not in cfg, "the guard group was not found; check the search path plugin"

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [
        instantiate(node)
        for node in cfg.callbacks.values()
        if isinstance(node, DictConfig) and "_target_" in node
    ]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=[])

    seen = [] if seen is None else seen
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            trainer.fit(model=model, datamodule=datamodule)
        finally:
            seen.extend(str(w.message) for w in record)

    ckpt_dir = Path(cfg.callbacks.model_checkpoint.dirpath)
    assert ckpt_dir == tmp_path / "checkpoints"
    checkpoints = {p.name: p for p in sorted(ckpt_dir.glob("*.ckpt"))}
    return Run(
        cfg=cfg,
        model=model,
        trainer=trainer,
        val_loss=float(trainer.callback_metrics["val/loss"]),
        checkpoints=checkpoints,
        warnings=seen,
    )


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The template without guardtrain, ``model.compile=false``: the reference run."""
    return run([], tmp_path_factory.mktemp("baseline"))


# -- checks on one checkpoint ------------------------------------------------------------------


def fixed_input() -> torch.Tensor:
    return torch.randn(16, 1, 4, 4, generator=torch.Generator().manual_seed(7))


def net_weights(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The network's entries of a LightningModule state_dict, without ``prefix``; nothing else."""
    assert all(k.startswith(prefix) for k in state_dict), sorted(state_dict)
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}


#: What the template's own ``self.net = torch.compile(self.net)`` leaves on the original
#: net (the OptimizedModule passes attribute writes on to it): torch sets
#: ``_is_torch_compile``, Lightning's wrapper of ``torch.compile`` ``_compile_kwargs``.
#: Both pickle; neither is guardtrain's.
TORCH_COMPILE_ATTRS = {"_is_torch_compile", "_compile_kwargs"}


def assert_plain_net(net: nn.Module, cfg: DictConfig, compiled_by_user: bool = False) -> None:
    """A net as Hydra builds it: no instance ``forward``, nothing of guardtrain, no hooks."""
    assert type(net) is SimpleDenseNet
    fresh = instantiate(cfg.model.net)
    for (name, module), (_, fresh_module) in zip(net.named_modules(), fresh.named_modules()):
        where = name or "net"
        attrs = vars(module)
        if compiled_by_user and module is net:
            attrs = {k: v for k, v in attrs.items() if k not in TORCH_COMPILE_ATTRS}
        assert "forward" not in attrs, f"{where} has an instance `forward`"
        assert not [a for a in attrs if "guardtrain" in a.lower()], f"{where}: {sorted(attrs)}"
        assert not [a for a, v in attrs.items() if type(v).__module__.startswith("guardtrain")], (
            f"{where} holds a guardtrain object"
        )
        # Exactly the attributes of a freshly built net (so no extra hooks or wrappers).
        assert set(attrs) == set(vars(fresh_module)), where
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            assert len(attrs[hooks]) == 0, f"{where}.{hooks}"
    pickle.dumps(net)  # and it pickles again


def assert_same_outputs(net: nn.Module, reference: nn.Module) -> None:
    """Bitwise the same outputs in eval() and, seeded identically, in train() (dropout, BatchNorm)."""
    assert net is not reference
    x = fixed_input()
    net.eval()
    reference.eval()
    with torch.no_grad():
        evaluated = net(x)
        assert torch.equal(evaluated, reference(x))
    net.train()
    reference.train()
    with torch.no_grad():
        torch.manual_seed(0)
        trained = net(x)
        torch.manual_seed(0)
        assert torch.equal(trained, reference(x))
        torch.manual_seed(1)
        other_draw = reference(x)
    # The train-mode comparison exercised dropout and BatchNorm batch statistics.
    assert not torch.allclose(trained, evaluated)
    assert not torch.allclose(trained, other_draw)


def assert_weights_only_refuses(path: Path) -> None:
    """torch.load's default (weights_only=True) refuses a pickled nn.Module.

    This is torch's own behaviour for the template's checkpoints (``net`` is in
    ``hyper_parameters``), with or without guardtrain: the run without
    guardtrain checks it too (test_baseline_checkpoints_load).
    """
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(path)


def reference_net(cfg: DictConfig, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A new, never compiled net with a checkpoint's weights."""
    net = instantiate(cfg.model.net)
    net.load_state_dict(weights, strict=True)
    return net


def check_checkpoint(path: Path, cfg: DictConfig) -> dict[str, torch.Tensor]:
    """``load_from_checkpoint(path, weights_only=False)``: plain net, eager outputs; its weights."""
    assert_weights_only_refuses(path)
    loaded = TemplateLitModule.load_from_checkpoint(path, weights_only=False)
    assert loaded.hparams.compile is False
    assert loaded.net is loaded.hparams.net
    assert_plain_net(loaded.net, cfg)
    # Clones: the train-mode calls below update BatchNorm's running statistics in place.
    weights = {k: v.clone() for k, v in net_weights(loaded.state_dict(), "net.").items()}
    assert_same_weights(weights, checkpoint_weights(path, "net."))
    assert_same_outputs(loaded.net, reference_net(cfg, weights))
    return weights


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"weights differ at {key}"


def checkpoint_weights(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=False)["state_dict"]
    return net_weights(state, prefix)


def took_over(messages: list[str]) -> list[str]:
    return [m for m in messages if TOOK_OVER in m]


# -- tests -------------------------------------------------------------------------------------


def test_baseline_checkpoints_load(baseline: Run) -> None:
    """Without guardtrain: the harness, and torch's own refusal under weights_only=True."""
    assert baseline.guard is None
    assert sorted(baseline.checkpoints) == CKPT_FILES
    assert 0.0 < baseline.val_loss < 2.0
    assert not took_over(baseline.warnings)
    for name in CKPT_FILES:
        check_checkpoint(baseline.checkpoints[name], baseline.cfg)
    # last.ckpt holds the trained model's weights.
    assert_same_weights(
        checkpoint_weights(baseline.checkpoints["last.ckpt"], "net."),
        net_weights(baseline.model.state_dict(), "net."),
    )


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_aggressive_eager_checkpoints_every_epoch(
    baseline: Run, tmp_path: Path, preset: str
) -> None:
    guarded = run([f"+guard={preset}", *AGGRESSIVE_EAGER[1:]], tmp_path)

    cb = guarded.guard
    assert cb is not None and cb.preset == preset
    if preset == "turbo":
        assert cb.summary()["direct_dispatch"]["calls"] > 0
    assert cb.compile_kwargs == {"backend": "eager"}
    summary = cb.summary()
    assert summary["targets"] == ["net"]
    assert summary["compiles"] >= 1
    assert summary["steady_steps"] > 0, summary
    assert not took_over(guarded.warnings)  # compile=false: nothing to take over
    assert_restored(guarded.model)

    assert guarded.val_loss == baseline.val_loss  # bitwise: eager backend, same seed
    assert sorted(guarded.checkpoints) == CKPT_FILES
    for name in CKPT_FILES:
        weights = check_checkpoint(guarded.checkpoints[name], guarded.cfg)
        assert_same_weights(weights, checkpoint_weights(baseline.checkpoints[name], "net."))
    assert_same_weights(
        checkpoint_weights(guarded.checkpoints["last.ckpt"], "net."),
        net_weights(guarded.model.state_dict(), "net."),
    )


def test_template_compile_true_is_taken_over(
    baseline: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``model.compile=true``: guardtrain compiles the original net itself, once, and says so.

    The reference is the run without guardtrain and ``model.compile=false`` (the
    template's own ``torch.compile`` would use inductor).
    """
    seen: list[str] = []
    guarded = run([*AGGRESSIVE_EAGER, "model.compile=true"], tmp_path, seen)

    logged = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    told = took_over(seen + logged)
    assert len(told) == 1, f"expected one warning containing {TOOK_OVER!r}, got {told}"
    summary = guarded.guard.summary()  # type: ignore[union-attr]
    assert summary["steady_steps"] > 0, summary
    # guardtrain's target is the template's net (not the whole LightningModule around
    # the user's OptimizedModule), and after the run the original net is plain again.
    assert len(summary["targets"]) == 1 and summary["targets"][0].split(".")[0] == "net", summary
    assert guarded.model.hparams.net is guarded.model.net._orig_mod
    assert_plain_net(guarded.model.hparams.net, guarded.cfg, compiled_by_user=True)
    assert guarded.val_loss == baseline.val_loss  # bitwise: guardtrain's eager compile ran

    assert sorted(guarded.checkpoints) == CKPT_FILES
    for name in CKPT_FILES:
        path = guarded.checkpoints[name]
        assert_weights_only_refuses(path)
        ckpt = torch.load(path, weights_only=False)
        # The template's keys with compile=true are kept: net._orig_mod.*
        weights = net_weights(ckpt["state_dict"], "net._orig_mod.")
        assert_same_weights(weights, checkpoint_weights(baseline.checkpoints[name], "net."))
        hparams = ckpt["hyper_parameters"]
        assert hparams["compile"] is True
        assert_plain_net(hparams["net"], guarded.cfg, compiled_by_user=True)
        # load_from_checkpoint (strict) cannot load net._orig_mod.* keys into the module
        # before its setup("fit") compiles `net`; that is the template's own behaviour.
        # Load the way the template's flow does: construct, setup("fit"), load_state_dict.
        loaded = TemplateLitModule(**hparams)
        loaded.setup("fit")
        loaded.load_state_dict(ckpt["state_dict"], strict=True)
        plain = loaded.net._orig_mod
        assert plain is hparams["net"]
        assert_same_outputs(plain, reference_net(guarded.cfg, weights))


@pytest.mark.slow
def test_aggressive_inductor_checkpoints_every_epoch(baseline: Run, tmp_path: Path) -> None:
    """The preset's own backend (inductor): val/loss within rtol 1e-3 of the run without it."""
    # Dropout in inductor's graphs draws as eager does only with fallback_random. Not
    # monkeypatch: its undo deletes the attribute, and a config module then hides the entry
    # (a later `torch._inductor.config.fallback_random` raises AttributeError).
    with torch._inductor.config.patch(fallback_random=True):
        guarded = run(
            [
                "+guard=aggressive",
                "callbacks.guard_tune.warmup_steps=3",
                "callbacks.guard_tune.stable_steps=2",
            ],
            tmp_path,
        )
    cb = guarded.guard
    assert cb is not None
    assert cb.compile_kwargs.get("backend", "inductor") == "inductor"
    assert cb.summary()["steady_steps"] > 0
    assert_restored(guarded.model)

    assert guarded.val_loss == pytest.approx(baseline.val_loss, rel=1e-3)
    assert sorted(guarded.checkpoints) == CKPT_FILES
    for name in CKPT_FILES:
        check_checkpoint(guarded.checkpoints[name], guarded.cfg)
