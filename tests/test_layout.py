"""The package's shape: a folder per concern, every module readable in one sitting, none importing in a cycle."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (REPO / "grpo").rglob("*.py") if p.name not in ("grpo.py", "grpo-async.py"))
LONG_TABLES = {"ifeval_checks.py",  # the 25 IFEval instruction checkers, one table
               "sandbox.py"}  # the launcher and every protection it applies, read together
# modules of GPU kernels: Triton comes with torch's CUDA wheels only
NEEDS_TRITON = ({"grpo.training.filled_slots_kernel", "grpo.inference.sampling_kernel"}
                if importlib.util.find_spec("triton") is None else set())


# sized by the idea a module holds, not cut to a line count (issue 69): past this it likely holds two
MAX_LINES = 400


def test_every_module_reads_in_one_sitting():
    long = {str(p.relative_to(REPO)): n for p in MODULES if p.name not in LONG_TABLES
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_imports_alone_first():
    """Each module imported first, in a fresh interpreter: a circular import fails whichever side is first."""
    names = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in MODULES]
    names = [name for name in names if name not in NEEDS_TRITON]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n    " \
           "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('grpo')]\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(names) > 30 and "grpo.training.step" in names


# docs are references, not lab notebooks (issue 69): history stays in git
DOC_LIMITS = {"README.md": 12_000, "benchmarks/README.md": 40_000}
DOCS_PAGE_LIMIT = 20_000


def test_docs_stay_within_their_sizes():
    limits = {**DOC_LIMITS, **{str(p.relative_to(REPO)): DOCS_PAGE_LIMIT for p in sorted((REPO / "docs").glob("*.md"))}}
    over = [f"{name} is {size:,} bytes (limit {limit:,})" for name, limit in limits.items()
            if (size := (REPO / name).stat().st_size) > limit]
    assert not over, "; ".join(over)
