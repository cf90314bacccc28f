"""``scripts/launch_bound_check.py`` (the GPU check's launch-bound case) on the CPU, tiny."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "launch_bound_check", ROOT / "scripts" / "launch_bound_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_on_the_cpu_with_a_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch._dynamo.reset()
    out = tmp_path / "launch.json"
    argv = ["--device", "cpu", "--backend", "eager", "--tiny", "--configs", "compile,turbo"]
    assert _script().main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| compile |" in printed and "| turbo |" in printed
    results = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"compile", "turbo"}
    turbo = results["turbo"]
    assert turbo["steady_before"] == turbo["steady_after"] == "steady"
    assert turbo["matches_eager"] is True and results["compile"]["matches_eager"] is True
    assert turbo["step_us"]["min"] <= turbo["step_us"]["median"] <= turbo["step_us"]["max"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_skips_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.delenv("GUARDTRAIN_GPU", raising=False)
    assert script.main([]) == 0
    assert script.main(["--require-gpu"]) == 1
    monkeypatch.setenv("GUARDTRAIN_GPU", "1")
    assert script.main([]) == 1


def test_gpu_check_script_parses_and_runs_the_case() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    path = ROOT / "scripts" / "gpu_check.sh"
    subprocess.run([bash, "-n", str(path)], check=True, timeout=60)
    assert "scripts/launch_bound_check.py --device cuda" in path.read_text()
