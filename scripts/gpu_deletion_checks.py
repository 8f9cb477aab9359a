"""Each GPU test of tests/gpu/ fails once the feature it guards is deleted: for each deletion below, a copy of
the checkout with those lines taken out, and the tests that must then fail, run in it (all at once).

Run on a lent GPU machine after scripts/device_env.sh (docs/develop/gpu_tests.md; its last run's outcome is
recorded there):

    python3 scripts/gpu_deletion_checks.py [--only NAME ...]

Prints one line per deletion: whether its tests failed, as they must, and their pytest summary; the logs go to
$OUT/deletion_checks.log. A deletion whose lines are no longer in the file says so: update it with the code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Deletion:
    name: str
    path: str
    code: str  # exactly as in the file
    replacement: str
    tests: tuple[str, ...]


DELETIONS = [
    Deletion("decode graph replay", "worker_svc/decode_graphs.py",
             "        graph.replay()\n", "", ("tests/gpu/test_decode_graphs.py",)),
    Deletion("decode graphs' pending tokens", "worker_svc/decode_graphs.py",
             "        if num_pending:\n            gather_pending_tokens(",
             "        if False:\n            gather_pending_tokens(", ("tests/gpu/test_decode_graphs.py",)),
    Deletion("mixed graphs' attention between pieces", "worker_svc/mixed_graphs.py",
             "                backend.paged_attention(call.query, call.kv_cache, metadata, call.scale, "
             "call.sliding_window,\n                                        call.logit_softcap, output=call.output, "
             "kv_scales=call.kv_scales)\n",
             "", ("tests/gpu/test_mixed_graphs.py", "tests/gpu/test_gpu_serve_check.py")),
    Deletion("symmetric all-reduce (None)", "worker_svc/tensor_parallel.py",
             "    symmetric = symmetric_all_reduce(group, dtype, device) if device.type == \"cuda\" and "
             "custom_all_reduce else None\n", "    symmetric = None\n",
             ("tests/gpu/test_symmetric_all_reduce_gpu.py",)),
    Deletion("symmetric all-reduce's kernel", "worker_svc/symmetric_all_reduce.py",
             "        torch.ops.symm_mem.two_shot_all_reduce_(staged, \"sum\", self.group_name)\n", "",
             ("tests/gpu/test_symmetric_all_reduce_gpu.py",)),
    Deletion("grammar bitmask applied", "worker_svc/model_runner.py",
             "        self.sampling_ops.apply_token_bitmask(logits, on_device, to_device(indices, self.device, "
             "torch.long))\n", "", ("tests/gpu/test_grammar_mask_stream.py",)),
    Deletion("draw waits for the mask copy stream", "worker_svc/model_runner.py",
             "            compute.wait_stream(self._mask_copies)\n", "",
             ("tests/gpu/test_grammar_mask_stream.py",)),
    Deletion("device busy clock's end events", "worker_svc/device_busy.py",
             "        return torch.cuda.Event(enable_timing=True) if self.enabled else None\n", "        return None\n",
             ("tests/gpu/test_device_busy_gpu.py",)),
    Deletion("device busy clock off", "worker_svc/model_runner.py",
             "        self.device_busy = DeviceBusyClock(enabled=self.on_gpu)\n",
             "        self.device_busy = DeviceBusyClock(enabled=False)\n", ("tests/gpu/test_device_busy_gpu.py",)),
    Deletion("draft model's graphs (eager dispatcher)", "worker_svc/model_runner.py",
             "            self.draft.graphs = self._dispatcher(self.draft.model, self.draft.pool.layers, setup, "
             "max_blocks_per_seq,\n                                                 with_lora=False)\n",
             "            self.draft.graphs = GraphDispatcher(self.draft.model, self.draft.pool.layers, "
             "setup.block_size, device)\n", ("tests/gpu/test_draft_graphs_gpu.py",)),
    Deletion("draft proposal passes' device tokens", "worker_svc/draft_model.py",
             "tables[active], sources=np.flatnonzero(keep))", "tables[active], sources=None)",
             ("tests/gpu/test_draft_graphs_gpu.py",)),
    Deletion("room for the draft's graphs", "worker_svc/kv_cache_sizing.py",
             "        reserved += draft_graph_bytes\n", "", ("tests/gpu/test_draft_graphs_gpu.py",)),
]


def checkout_without(deletion: Deletion, root: Path) -> Path:
    """A copy of the checkout under `root` with the deletion applied."""
    copy = root / deletion.name.replace(" ", "_").replace("'", "").replace("(", "").replace(")", "")
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".whl", ".venv", "__pycache__"))
    source = copy / deletion.path
    text = source.read_text()
    if text.count(deletion.code) != 1:
        raise SystemExit(f"{deletion.name}: its code is no longer in {deletion.path} once: update this check")
    source.write_text(text.replace(deletion.code, deletion.replacement))
    return copy


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="names of the deletions to check (default: all)")
    args = parser.parse_args()
    chosen = [d for d in DELETIONS if not args.only or d.name in args.only]
    root = Path(tempfile.mkdtemp(prefix="deleted-"))
    log = Path(os.environ.get("OUT", ".")) / "deletion_checks.log"
    runs = []
    for deletion in chosen:
        copy = checkout_without(deletion, root)
        env = {**os.environ, "TRITON_INTERPRET": "0",
               "PYTHONPATH": os.pathsep.join([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                              if p and Path(p).resolve() != REPO] + [str(copy)])}
        out = open(copy / "pytest.log", "w")
        process = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                    *deletion.tests], cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT)
        runs.append((deletion, copy, process, time.monotonic()))
    failed_to_fail = 0
    with open(log, "w") as report:
        for deletion, copy, process, started in runs:
            code = process.wait()
            output = (copy / "pytest.log").read_text(errors="replace")
            summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
            verdict = "fails, as it must" if code == 1 else "DOES NOT FAIL" if code == 0 else f"exit {code}"
            failed_to_fail += code == 0
            line = f"{deletion.name}: {verdict} ({', '.join(deletion.tests)}: {summary}; {time.monotonic() - started:.0f} s)"
            print(line, flush=True)
            report.write(f"===== {line}\n{output}\n")
    return 1 if failed_to_fail else 0


if __name__ == "__main__":
    sys.exit(main())
