"""The main demo, on CPU: a 2-rank DDP LightningCLI run meets a GPU fault, saves, stops, and resumes exactly.

1. Train with every feature on (examples/lightning_cli.yaml). A fault drill injects XID 79 ("GPU has fallen
   off the bus") on rank 1 at step 25: both ranks agree, save step 25, commit it and exit with code 69.
2. Relaunch the same command, as torchrun --max_restarts or a SLURM requeue would: it resumes at step 25 and
   finishes.
3. Show the checkpoints in both tiers, verify them, and print the goodput report (with a timeline plot).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "runs", "lightning-cli")
FIT = [
    sys.executable,
    os.path.join(ROOT, "examples", "lightning_cli.py"),
    "fit",
    "--config",
    os.path.join(ROOT, "examples", "lightning_cli.yaml"),
]
CLI = [sys.executable, "-m", "resilience.cli"]


def run(title: str, command: list[str], env: dict[str, str] | None = None, *, whole: bool = False) -> int:
    """Run one step of the demo; of a training run's output, show only the lines that tell the story."""
    print(
        f"\n=== {title}\n$ {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in command)}",
        flush=True,
    )
    result = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    keep = (
        "rank",
        "Restor",
        "resumed",
        "fit` stopped",
        "exit",
        "emergency",
        "step",
        "STEP",
        "Goodput",
        "OK",
        "FAIL",
        "%",
        "BUCKET",
        "#",
    )
    for line in result.stdout.splitlines():
        if whole or (any(word in line for word in keep) and "Warning" not in line and "warn(" not in line):
            print("  " + line)
    print(f"  -> exit code {result.returncode}")
    return result.returncode


def main() -> None:
    shutil.rmtree(RUN, ignore_errors=True)
    code = run(
        "1. train; a drill injects XID 79 on rank 1 at step 25", FIT, {"RESILIENCE_INJECT": "xid=79@step=25,rank=1"}
    )
    if code != 69:
        sys.exit(f"expected exit code 69 (GPU fault: saved and stopped), got {code}")
    code = run("2. relaunch the same command: it resumes at step 25", FIT)
    if code != 0:
        sys.exit(f"the resumed run failed with exit code {code}")
    run(
        "3a. checkpoints in both tiers",
        [*CLI, "ls", os.path.join(RUN, "checkpoints"), f"file://{RUN}/durable"],
        whole=True,
    )
    if run("3b. verify every checksum", [*CLI, "verify", os.path.join(RUN, "checkpoints")], whole=True) != 0:
        sys.exit("verification failed")
    plot = os.path.join(RUN, "goodput.png")
    run("3c. where the time went, across both runs", [*CLI, "report", RUN, "--plot", plot], whole=True)
    print(f"\nTimeline plot: {os.path.relpath(plot, ROOT)}")


if __name__ == "__main__":
    main()
