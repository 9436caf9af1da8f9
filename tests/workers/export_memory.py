"""Exports a committed step in a process of its own and reports its memory: the peak resident set of this
program (``VmHWM``: unlike ``ru_maxrss`` it starts afresh at exec, not with the parent's size) and the
resident set just before the export, after every import.

Usage: export_memory.py ROOT OUT FORMAT BUDGET_BYTES. Prints one JSON line: baseline_bytes, peak_bytes,
tensor_bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from resilience.formats.export import export


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise LookupError(field)


root, out, fmt, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
baseline = status_bytes("VmRSS")
done = export(root, out, format=fmt, budget_bytes=budget, weights="model" if fmt == "safetensors" else None)
print(json.dumps({"baseline_bytes": baseline, "peak_bytes": status_bytes("VmHWM"), "tensor_bytes": done.tensor_bytes}))
