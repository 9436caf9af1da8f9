"""Run Accelerate's own tests stock and with ``attach()`` on every Accelerator; summarise.

Accelerate's tests are not part of this project: they are extracted elsewhere (see README.md) and only pointed
to here. Each mode is one pytest process over the test files. The per-test results come from the Lightning
runner's pytest plugin (``tools/lightning_suite/suite_results.py``) and are folded by its functions, so both
peer judges count alike. Writes ``summary.json`` and ``summary.md`` (and each mode's ``results.jsonl``,
``accelerators.jsonl`` and ``pytest.log``) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LIGHTNING_SUITE = HERE.parent / "lightning_suite"
_spec = importlib.util.spec_from_file_location("lightning_suite_run", LIGHTNING_SUITE / "run.py")
assert _spec is not None and _spec.loader is not None
shared = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up there
_spec.loader.exec_module(shared)

DEFAULT_FILES = ["tests/test_state_checkpointing.py", "tests/test_accelerator.py"]
BAD = ("failed", "error", "timeout", "missing")


def pytest_cmd(args: argparse.Namespace, plugged: bool, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir=.", "--color=no", "-q"]
    cmd += ["-p", "suite_results", f"--timeout={args.timeout}"]
    if plugged:
        cmd += ["-p", args.plugin]
    return [*cmd, *args.files, *extra, *args.pytest_args]


def env_for(args: argparse.Namespace, results: Path, record: Path, io_base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}  # no settings of the caller's
    env["HF_HOME"] = str(io_base / "hf-home")  # nor their accelerate config file
    paths = [str(HERE), str(LIGHTNING_SUITE), *args.pythonpath, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(LR_SUITE_RESULTS=str(results), LA_SUITE_RECORD=str(record), LA_SUITE_IO_BASE=str(io_base))
    env["LA_SUITE_ROOTS"] = args.roots
    return env


def collect(args: argparse.Namespace, cwd: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="la-suite-collect-") as base:
        env = env_for(args, Path(os.devnull), Path(os.devnull), Path(base))
        out = subprocess.run(
            pytest_cmd(args, False, ("--collect-only",)), cwd=cwd, env=env, capture_output=True, text=True
        )
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"collected no tests:\n{out.stdout}\n{out.stderr}")
    return ids


def run_mode(args: argparse.Namespace, mode: str, ids: list[str], cwd: Path) -> dict[str, Any]:
    out = args.out / mode
    out.mkdir(parents=True, exist_ok=True)
    results, record, log = out / "results.jsonl", out / "accelerators.jsonl", out / "pytest.log"
    for stale in (results, record, log):
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"la-suite-{mode}-") as io_base:
        finished = shared.run(
            pytest_cmd(args, mode == "plugged"), cwd, env_for(args, results, record, Path(io_base)), log, args.limit
        )
    tests = shared.fold(results)
    for test_id in ids:
        t = tests.setdefault(test_id, shared.Outcome())
        if t.outcome == "missing":
            t.outcome = "missing" if finished else "timeout"
            t.message = "no result (process died?)" if finished else "timed out (process killed)"
    return tests


def summarise(args: argparse.Namespace, ids: list[str], modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"title": args.title, "label": args.label, "files": args.files, "tests": len(ids)}
    summary.update(attached=args.attached, modes={})
    for mode, tests in modes.items():
        counts: dict[str, int] = {}
        for t in tests.values():
            counts[t.outcome] = counts.get(t.outcome, 0) + 1
        stock = modes.get("stock", {})
        failures = [
            {
                "id": i,
                "outcome": tests[i].outcome,
                "reason": shared.reason(tests[i]),
                "stock": stock[i].outcome if i in stock else None,
            }
            for i in ids
            if tests[i].outcome in BAD
        ]
        entry: dict[str, Any] = {"counts": counts, "failures": failures}
        if mode == "plugged" and "stock" in modes:
            entry["passed_stock_not_plugged"] = [
                i for i in ids if stock[i].outcome == "passed" and tests[i].outcome != "passed"
            ]
        record = args.out / mode / "accelerators.jsonl"
        if mode == "plugged" and record.exists():
            made = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]
            entry["attached"] = sum(1 for e in made if e["attached"])
            entry["not_attached"] = sorted({e["why"] for e in made if not e["attached"]})
        summary["modes"][mode] = entry
    return summary


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['title']} ({summary['label']}): {summary['tests']} tests", "", "Files: "]
    lines[-1] += ", ".join(f"`{f}`" for f in summary["files"])
    lines += ["", "| mode | " + " | ".join(shared.OUTCOMES) + " |", "|---" * (len(shared.OUTCOMES) + 1) + "|"]
    for mode, entry in summary["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(str(entry["counts"].get(o, 0)) for o in shared.OUTCOMES) + " |")
    for mode, entry in summary["modes"].items():
        if "attached" in entry:
            lines += ["", f"{summary['attached']} attached: {entry['attached']}."]
            lines += [f"Not attached: {why}" for why in entry["not_attached"]]
        if entry.get("passed_stock_not_plugged") is not None:
            lines.append(f"Passed stock, not plugged: {len(entry['passed_stock_not_plugged'])}.")
        if entry["failures"]:
            lines += ["", f"## {mode}: failures", ""]
            for f in entry["failures"]:
                stock = "" if f["stock"] in (None, "passed") or mode == "stock" else f" (stock: {f['stock']})"
                lines.append(f"- `{f['id']}` {f['outcome']}{stock}: {f['reason'].replace('|', chr(92) + '|')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests-root", type=Path, required=True, help="the folder holding Accelerate's tests/, extracted")
    p.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files under --tests-root")
    p.add_argument("--out", type=Path, default=Path("accelerate-suite-results"), help="where results go")
    p.add_argument("--modes", nargs="+", choices=["stock", "plugged"], default=["stock", "plugged"])
    p.add_argument("--pythonpath", nargs="*", default=[], help="extra import paths (test-only dependencies)")
    p.add_argument(
        "--roots", choices=["project", "test"], default="project", help="local_root from project_dir, or per test"
    )
    p.add_argument("--timeout", type=int, default=300, help="pytest-timeout limit per test, seconds")
    p.add_argument("--limit", type=float, default=3600, help="wall-clock limit per mode, seconds")
    p.add_argument("--label", default="accelerate v1.14.0 tests", help="what was extracted, for the summary")
    p.add_argument("--title", default="Accelerate's tests", help="the summary's heading")
    p.add_argument("--plugin", default="attach_plugin", help="the pytest plugin that plugs the pack in")
    p.add_argument("--attached", default="Accelerators", help="what the plugin attaches to, for the summary")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.pythonpath = [str(Path(x).resolve()) for x in args.pythonpath]
    cwd = args.tests_root.resolve()
    ids = collect(args, cwd)
    modes = {mode: run_mode(args, mode, ids, cwd) for mode in args.modes}
    summary = summarise(args, ids, modes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (args.out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    for mode, entry in summary["modes"].items():
        print(f"{mode}: {entry['counts']}")
    print(f"summary: {args.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
