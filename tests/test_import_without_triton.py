"""The CPU image has no Triton (Dockerfile, DEVICE=cpu): the worker and every service must import without it,
Triton kernels being imported only where a GPU runs them. A worker that imported them at the top of a module
restarted forever in the CPU compose stack (found by scripts/compose_smoke.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A meta-path finder that refuses Triton, run in a fresh interpreter (this one may have imported it).
PROGRAM = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name=name)
        return None
sys.meta_path.insert(0, NoTriton())
import worker_svc.main, worker_svc.serving_loop, worker_svc.worker, scheduler_svc.main, gateway.main, pagedserve.cli
print("ok")
"""


def test_the_services_import_without_triton():
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
