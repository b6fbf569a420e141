"""Lower layers never import higher ones: the cost model runs on a base install (no torch,
transformers or click), and only the CLI imports click."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "planner"
HEAVY = {"torch", "transformers", "safetensors", "optuna", "matplotlib", "sklearn", "scipy", "statsmodels"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_cost_and_arch_import_no_heavy_dependency():
    for sub in ("arch", "cost"):
        for path in (PACKAGE / sub).glob("*.py"):
            assert not imports_of(path) & HEAVY, path


def test_only_the_cli_imports_click():
    cli = PACKAGE / "cli"
    assert any("click" in imports_of(path) for path in cli.glob("*.py"))
    for path in PACKAGE.rglob("*.py"):
        if cli not in path.parents:
            assert "click" not in imports_of(path), path


def test_cost_never_imports_upward():
    for path in (PACKAGE / "cost").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("planner."):
                top = node.module.split(".")[1]
                allowed = {"arch", "cost", "errors", "files", "specs", "units"} | ({"catalog"} if path.name == "fit.py" else set())
                assert top in allowed, (path, node.module)


def test_plan_module_stays_light():
    assert not imports_of(PACKAGE / "plan.py") & (HEAVY | {"click"})


def test_suggest_and_preflight_run_without_torch_or_sklearn():
    """The fitted estimator predicts with numpy; the search needs optuna only."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from planner.search.suggest import Request, suggest\n"
        "assert suggest(Request(trials=20)).options\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'sklearn', 'scipy', 'matplotlib', 'statsmodels') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
