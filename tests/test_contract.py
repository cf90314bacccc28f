"""The engine's contract with its adapters, kept by walking their code.

The adapters (the Lightning callback, ``GuardTuner``, the Trainer callback, what they
share), the bench and the speed suite (``benchmarks/``) drive a :class:`~guardtrain.engine.engine.GuardEngine` through
what it shows, and nothing else: they never reach its parts (``engine.run``, its phase
machine, its Dynamo settings, a private name), torch's stance, Dynamo's config or the
guard-collectives hook. What guardtrain changes in the process goes through
:data:`~guardtrain.engine.process.PROCESS` (design.md, "Global state has one owner").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from guardtrain.engine.engine import GuardEngine

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = [
    "guardtrain/callback.py",
    "guardtrain/tuner.py",
    "guardtrain/hf.py",
    "guardtrain/hf_accelerate.py",
    "guardtrain/view.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "guardtrain/bench").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")),
]

PARTS = {"run", "dynamo", "machine", "session", "_repairs", "_batches"}
"""The engine's parts: never read from outside it."""
STANCE = {"_stance", "set_stance", "skip_guard_eval_unsafe", "eval_frame"}
"""Torch's stance, and the module that holds it."""
PROCESS_WIDE = {"set_enable_guard_collectives"}
"""Process state that only a run's Dynamo settings write (Dynamo's config writes are
found by :func:`_process_writes`)."""


def _shown() -> set[str]:
    """What the engine shows: its public methods and properties."""
    return {name for name in dir(GuardEngine) if not name.startswith("_")} | {
        "compile_cache",
        "metrics",
    }


def _engine_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, attribute)`` for every attribute read on an expression naming an engine
    (``engine``, ``self._engine``, ``tuner._engine``, ...)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value).split(".")[-1] in (
            "engine",
            "_engine",
        ):
            found.append((node.lineno, node.attr))
    return found


def _process_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Writes of Dynamo's config (``cfg.x = ...``, ``setattr(cfg, ...)``)."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and "config" in ast.unparse(t.value):
                found.append((node.lineno, ast.unparse(t)))
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "setattr"
            and node.args
            and ("cfg" in ast.unparse(node.args[0]) or "config" in ast.unparse(node.args[0]))
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", ADAPTERS)
def test_adapters_read_only_what_the_engine_shows(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    shown = _shown()
    wrong = [
        f"{path}:{line}: engine.{attr}"
        for line, attr in _engine_reads(tree)
        if attr in PARTS or attr not in shown
    ]
    assert not wrong, "reaches past the engine's contract:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", ADAPTERS)
def test_adapters_leave_process_state_to_its_owner(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    wrong = [
        f"{path}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in STANCE | PROCESS_WIDE)
        or (isinstance(node, ast.Name) and node.id in STANCE | PROCESS_WIDE)
        or (isinstance(node, ast.alias) and node.name.split(".")[-1] in STANCE)
    ]
    wrong += [f"{path}:{line}: {text}" for line, text in _process_writes(tree)]
    assert not wrong, "process state changed outside its owner:\n" + "\n".join(wrong)


def test_the_walk_sees_a_reach() -> None:
    """The walks find what they look for (else every test above passes on nothing)."""
    code = ast.parse(
        "engine.run.active\nself._engine.machine.loops\ntorch._dynamo.eval_frame._stance\n"
        "setattr(cfg, 'x', 1)\ntorch._dynamo.config.install_free_tensors = True\n"
    )
    assert [a for _, a in _engine_reads(code)] == ["run", "machine"]
    assert len(_process_writes(code)) == 2
    assert "run" in PARTS and "run" not in _shown() - PARTS


# -- one door to PyTorch's internals -----------------------------------------------------------

PRIVATE_TORCH = (
    "torch._dynamo",
    "torch._C",
    "torch._guards",
    "torch._inductor",
    "torch._subclasses",
    "torch._functorch",
    "torch._logging",
)
"""Private PyTorch names: the package reaches them through ``guardtrain/_torch.py`` alone."""
DOOR = "guardtrain/_torch.py"


def test_private_torch_names_are_reached_through_one_module() -> None:
    """Outside the door (and the bench), no file of the package names a private PyTorch
    module, in code, docstrings or comments: a torch release that moves one breaks one
    file, whose table says which releases each entry was checked on."""
    package = ROOT / "guardtrain"
    found = []
    for path in sorted(package.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name == DOOR or name.startswith("guardtrain/bench/"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(private in line for private in PRIVATE_TORCH):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    door = (ROOT / DOOR).read_text(encoding="utf-8")
    assert "| entry | private source | what for | checked on |" in door


def _private_names() -> set[str]:
    """The private attribute names (``_x``, not ``__x__``) of the torch, Lightning and
    accelerate objects guardtrain touches: modules, tensors, parameters, optimizers, LR
    schedulers, hook handles, Dynamo's eval-frame and module-hook globals, the Trainer,
    the LightningModule, accelerate's state."""
    from collections import OrderedDict

    import torch
    import torch.nn.modules.module as module_module
    from torch import nn
    from torch.optim import optimizer as optimizer_module
    from torch.utils.hooks import RemovableHandle

    from guardtrain._torch import eval_frame

    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    optimizer.step()  # its first step marks the optimizer
    objects: list[object] = [
        nn.Module(),
        nn.Linear(1, 1),
        nn.Module,
        torch.Tensor,
        nn.Parameter(torch.ones(1)),
        optimizer,
        torch.optim.Optimizer,
        scheduler,
        torch.compile(nn.Linear(1, 1)),  # an OptimizedModule (nothing is compiled)
        RemovableHandle(OrderedDict()),
        module_module,
        optimizer_module,
        eval_frame,
    ]
    try:
        import lightning.pytorch as pl

        objects += [pl.LightningModule(), pl.LightningModule, pl.Trainer]
    except ImportError:  # pragma: no cover - a dev dependency
        pass
    try:
        from accelerate.state import AcceleratorState, PartialState

        objects += [AcceleratorState, PartialState]
    except ImportError:  # pragma: no cover - a dev dependency
        pass
    names: set[str] = set()
    for obj in objects:
        for name in (*vars(obj), *dir(obj)):
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _private_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` for each attribute named like one of ``names`` and each string that
    is one of them (``getattr(m, "_buffers")``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "torch",
            "lightning",
            "accelerate",
            "transformers",
        ):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("_")]
    return found


def test_private_attributes_are_reached_through_one_module() -> None:
    """Outside the door (the bench too), no file of the package reads, writes or names a
    private attribute of a torch, Lightning or accelerate object, nor imports a private
    name from them: each is a name in ``guardtrain/_torch.py``'s table."""
    names = _private_names()
    assert {"_parameters", "_stance", "_orig_mod", "_compiler_ctx", "_opt_called"} <= names
    found = []
    for path in sorted((ROOT / "guardtrain").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name == DOOR:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{name}:{line}: {text}" for line, text in _private_uses(tree, names)]
    assert not found, "\n".join(found)


def test_the_private_walk_sees_a_reach() -> None:
    code = ast.parse(
        "m._buffers\ngetattr(m, '_compiled_call_impl')\nfrom torch.optim.optimizer import "
        "_global_optimizer_pre_hooks\nself._mine\n"
    )
    names = _private_names()
    assert sorted(text for _, text in _private_uses(code, names)) == [
        "'_compiled_call_impl'",
        "_global_optimizer_pre_hooks",
        "m._buffers",
    ]
