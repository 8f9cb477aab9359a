"""One line per W1 JSON in a folder (offline_throughput.py's output): setting, tok/s, TPOT, KV blocks, device busy,
fraction of the setting's own floor (its weight and KV bytes, its prefill's tensor-core rate). Usage: python3 benchmarks/summarize_w1.py DIR > summary.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    rows = {}
    for path in sorted(Path(sys.argv[1]).glob("w1_*.json")):
        summary = json.loads(path.read_text())
        run = summary["runs"]["pagedserve"]
        rows[path.stem] = {key: run.get(key) for key in (
            "output_tokens_per_s", "elapsed_s", "first_run_elapsed_s", "tpot_median_ms", "num_kv_blocks",
            "device_busy_steady_decode", "preemptions", "ready_s")}
        rows[path.stem]["fraction_of_floor"] = summary["ratios"].get("pagedserve_fraction_of_floor")
        rows[path.stem]["floor"] = summary["floor"]
        rows[path.stem]["device"] = summary["device"]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
