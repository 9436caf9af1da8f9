"""Run a Lightning test suite stock and with ``ResilientCheckpointIO`` plugged into every Trainer (or Fabric);
summarise.

Lightning's tests are not part of this project: they are extracted elsewhere (see README.md) and only pointed
to here. Each mode is one pytest process for most tests, plus one process per test whose id matches
``--isolate`` (DDP tests: Lightning's DDP launcher re-runs pytest's command line in the other ranks, and a
failing rank can leave the others hanging, so they get a process and a wall-clock limit of their own).

Writes ``summary.json`` and ``summary.md`` (and the raw per-phase results and pytest logs) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Ordered: the first rule whose pattern is found in the test's failing line, the exception message or the
# traceback names the category. They describe what the test does that a CheckpointIO cannot satisfy.
CATEGORIES: list[tuple[str, str]] = [
    ("timed out", r"Failed: Timeout >"),  # pytest-timeout's message
    ("counts torch.save calls", r"save_mock|torch\.save\.call_count|MagicMock name='save'"),
    ("test loads .ckpt with torch.load/load_from_checkpoint", r"torch\.load\(|pl_load\(|load_from_checkpoint|Unpickl"),
    ("pickles the trainer", r"cannot pickle|Can't pickle|PicklingError"),
    ("leaves threads behind (conftest thread check)", r"Test left zombie thread"),
    ("rank-0-only save under a multi-process strategy", r"called on one rank only|ResilientDDPStrategy needs"),
    ("passes storage_options per save", r"storage_options per save"),
]
# Tests whose Trainers use one of these strategies are reported apart: the plain CheckpointIO is not how the
# pack supports several processes (that is ``strategy="resilient_ddp"``, which rejects spawn launchers).
MULTI_PROCESS = re.compile(r"ddp|DDP|fsdp|FSDP|deepspeed|DeepSpeed")


@dataclass
class Outcome:
    """One test's result in one mode, folded from its setup/call/teardown reports."""

    outcome: str = "missing"  # passed, failed, error, skipped, xfailed, timeout, missing
    message: str = ""
    test_line: str = ""
    text: str = ""
    phases: list[str] = field(default_factory=list)
    also: list[str] = field(default_factory=list)  # later phases' failures, e.g. a teardown check after the call


def pytest_cmd(args: argparse.Namespace, plugged: bool, targets: list[str], extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir=.", "--color=no", "-q"]
    cmd += ["-p", "suite_results", f"--timeout={args.timeout}"]
    if plugged:
        cmd += ["-p", "resilient_io_plugin"]
    ignored = [f"--ignore={suite}/{name}" for suite in args.suite for name in args.ignore]
    return cmd + targets + ignored + extra + args.pytest_args


def env_for(args: argparse.Namespace, results: Path, record: Path, io_base: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(HERE), *args.pythonpath, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(LR_SUITE_RESULTS=str(results), LR_SUITE_RECORD=str(record), LR_SUITE_IO_BASE=str(io_base))
    env["LR_SUITE_IO_SCOPE"] = args.io_scope
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, limit: float) -> bool:
    """Run one pytest; on timeout kill its whole process group (DDP ranks included). False if it timed out."""
    with log.open("a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
            return True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[run.py] killed after {limit:.0f} s\n")
            return False


def collect(args: argparse.Namespace, cwd: Path) -> list[str]:
    cmd = pytest_cmd(args, plugged=False, targets=args.suite, extra=["--collect-only"])
    out = subprocess.run(cmd, cwd=cwd, env=env_for(args, *[Path(os.devnull)] * 3), capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"collected no tests:\n{out.stdout}\n{out.stderr}")
    return ids


def pack_import_error(args: argparse.Namespace, cwd: Path) -> str | None:
    """Why ``lightning_resilience`` does not import in the test environment, checked before a plugged run."""
    cmd = [sys.executable, "-c", "from lightning_resilience import ResilientCheckpointIO"]
    out = subprocess.run(cmd, cwd=cwd, env=env_for(args, *[Path(os.devnull)] * 3), capture_output=True, text=True)
    if out.returncode == 0:
        return None
    return (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]


def fold(results: Path) -> dict[str, Outcome]:
    """Fold per-phase reports: a skip or failure in setup wins, then the call, then a teardown error."""
    tests: dict[str, Outcome] = {}
    if not results.exists():
        return tests
    for line in results.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        t = tests.setdefault(r["id"], Outcome(outcome="passed"))
        t.phases.append(f"{r['when']}:{r['outcome']}")
        if r["outcome"] == "skipped" and t.outcome == "passed":
            t.outcome, t.message = ("xfailed" if r["xfail"] else "skipped"), r["message"]
        elif r["outcome"] == "failed" and t.outcome not in ("failed", "error"):
            t.outcome = "failed" if r["when"] == "call" else "error"
            t.message, t.test_line, t.text = r["message"], r.get("test_line", ""), r["text"]
        elif r["outcome"] == "failed":
            t.also.append(f"{r['when']}: {shorten((r['message'].strip().splitlines() or [''])[0], 120)}")
    return tests


def run_mode(args: argparse.Namespace, mode: str, ids: list[str], cwd: Path) -> dict[str, Outcome]:
    out = args.out / mode
    out.mkdir(parents=True, exist_ok=True)
    results, record, log = out / "results.jsonl", out / "trainers.jsonl", out / "pytest.log"
    for stale in (results, record, log):
        stale.unlink(missing_ok=True)
    isolated = [i for i in ids if args.isolate and re.search(args.isolate, i)]
    with tempfile.TemporaryDirectory(prefix=f"lr-suite-{mode}-") as io_base:
        env = env_for(args, results, record, Path(io_base))
        plugged = mode == "plugged"
        bulk = pytest_cmd(args, plugged, args.suite, [f"--deselect={i}" for i in isolated])
        finished = {"bulk": run(bulk, cwd, env, log, args.bulk_limit)}
        for test_id in isolated:
            finished[test_id] = run(pytest_cmd(args, plugged, [test_id], []), cwd, env, log, args.test_limit)
    tests = fold(results)
    for test_id in ids:
        t = tests.setdefault(test_id, Outcome())
        if t.outcome == "missing" or (t.phases and t.phases[-1] != "teardown:passed" and t.outcome == "passed"):
            timed_out = not finished.get(test_id, finished["bulk"])
            t.outcome = "timeout" if timed_out else "missing"
            t.message = "timed out (process killed)" if timed_out else "no result (process died?)"
    return tests


def categorize(t: Outcome, strategies: list[str]) -> str:
    text = f"{t.test_line}\n{t.message}\n{t.text}"
    category = next((name for name, pattern in CATEGORIES if re.search(pattern, text)), "other")
    if t.outcome == "timeout":
        category = "timed out"
    if any(MULTI_PROCESS.search(s) for s in strategies):
        return f"multi-process strategy ({', '.join(strategies)}): {category}"
    return category


def shorten(text: str, limit: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def reason(t: Outcome) -> str:
    """The exception's first line, and the test's own line that raised it: enough to see why at a glance."""
    first = shorten((t.message.strip().splitlines() or [""])[0], 150)
    first = f"{first} [at: {shorten(t.test_line, 90)}]" if t.test_line else first
    return "; ".join([first, *t.also])


def trainers_by_test(path: Path) -> dict[str, list[dict[str, Any]]]:
    by_test: dict[str, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            by_test.setdefault(entry["test"], []).append(entry)
    return by_test


def summarise(args: argparse.Namespace, ids: list[str], modes: dict[str, dict[str, Outcome]]) -> dict[str, Any]:
    bad = ("failed", "error", "timeout", "missing")
    summary: dict[str, Any] = {"label": args.label, "suite": args.suite, "tests": len(ids), "modes": {}}
    for mode, tests in modes.items():
        counts: dict[str, int] = {}
        for t in tests.values():
            counts[t.outcome] = counts.get(t.outcome, 0) + 1
        trainers = trainers_by_test(args.out / mode / "trainers.jsonl")
        failures = []
        for test_id in ids:
            t = tests[test_id]
            if t.outcome not in bad:
                continue
            used = trainers.get(test_id, [])
            strategies = sorted({e.get("strategy_replaced_by", e["strategy"]) for e in used})
            stock = modes.get("stock", {}).get(test_id)
            failures.append(
                {
                    "id": test_id,
                    "outcome": t.outcome,
                    "reason": reason(t),
                    "category": categorize(t, strategies),
                    "message": t.message,
                    "stock": stock.outcome if stock else None,
                    "trainers": len(used),
                    "plugged_trainers": sum(1 for e in used if e.get("injected")),
                    "strategies": strategies,
                    "phases": t.phases,
                    "also": t.also,
                }
            )
        entry: dict[str, Any] = {"counts": counts, "failures": failures}
        if mode == "plugged":
            plugged_ids = {test_id for test_id, used in trainers.items() if any(e.get("injected") for e in used)}
            entry["tests_with_a_plugged_trainer"] = len(plugged_ids & set(ids))
            entry["passed_without_a_plugged_trainer"] = sorted(
                i for i in ids if tests[i].outcome == "passed" and i not in plugged_ids
            )
        summary["modes"][mode] = entry
    return summary


def markdown(summary: dict[str, Any]) -> str:
    suites = ", ".join(f"`{suite}`" for suite in summary["suite"])
    lines = [f"# Lightning's {suites} ({summary['label']}): {summary['tests']} tests", ""]
    lines += ["| mode | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    for mode, entry in summary["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(str(entry["counts"].get(o, 0)) for o in OUTCOMES) + " |")
    for mode, reason in summary.get("not_run", {}).items():
        lines += ["", f"**{mode} not run**: {reason}"]
    for mode, entry in summary["modes"].items():
        if "tests_with_a_plugged_trainer" in entry:
            plugged = entry["tests_with_a_plugged_trainer"]
            lines += ["", f"Tests in which at least one Trainer or Fabric got the plugin: {plugged}."]
            passed_without = len(entry["passed_without_a_plugged_trainer"])
            lines.append(f"Passed without any plugged Trainer or Fabric: {passed_without}.")
        if not entry["failures"]:
            continue
        lines += ["", f"## {mode}: failures", ""]
        by_category: dict[str, list[dict[str, Any]]] = {}
        for f in entry["failures"]:
            by_category.setdefault(f["category"], []).append(f)
        for category, failures in sorted(by_category.items(), key=lambda kv: -len(kv[1])):
            lines += [f"### {category} ({len(failures)})", ""]
            for f in failures:
                stock = "" if f["stock"] in (None, "passed") or mode == "stock" else f" (stock: {f['stock']})"
                reason = f["reason"].replace("|", "\\|")
                lines.append(f"- `{f['id']}` {f['outcome']}{stock}: {reason}")
            lines.append("")
    return "\n".join(lines) + "\n"


OUTCOMES = ["passed", "failed", "error", "skipped", "xfailed", "timeout", "missing"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests-root", type=Path, required=True, help="Lightning's tests/tests_pytorch, extracted")
    p.add_argument(
        "--suite", nargs="+", default=["checkpointing"], help="directories, files or test ids under --tests-root"
    )
    p.add_argument("--ignore", nargs="*", default=["test_legacy_checkpoints.py"], help="files in --suite to skip")
    p.add_argument("--out", type=Path, default=Path("lightning-suite-results"), help="where results go")
    p.add_argument("--modes", nargs="+", choices=["stock", "plugged"], default=["stock", "plugged"])
    p.add_argument("--pythonpath", nargs="*", default=[], help="extra import paths (test-only dependencies)")
    p.add_argument("--isolate", default="ddp", help="regex: matching test ids get a pytest process each")
    p.add_argument("--io-scope", choices=["test", "trainer"], default="test", help="local_root per test or Trainer")
    p.add_argument("--timeout", type=int, default=300, help="pytest-timeout limit per test, seconds")
    p.add_argument("--test-limit", type=float, default=600, help="wall-clock limit per isolated process, seconds")
    p.add_argument("--bulk-limit", type=float, default=5400, help="wall-clock limit for the main process, seconds")
    p.add_argument("--label", default="Lightning 2.6.5 tests", help="what was extracted, for the summary")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.pythonpath = [str(Path(x).resolve()) for x in args.pythonpath]
    cwd = args.tests_root.resolve()

    ids = collect(args, cwd)
    modes: dict[str, dict[str, Outcome]] = {}
    not_run: dict[str, str] = {}
    for mode in args.modes:
        if mode == "plugged" and (problem := pack_import_error(args, cwd)):
            not_run[mode] = f"lightning_resilience does not import: {problem}"
            print(f"{mode}: not run: {not_run[mode]}", file=sys.stderr)
            continue
        start = time.monotonic()
        modes[mode] = run_mode(args, mode, ids, cwd)
        print(f"{mode}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    summary = summarise(args, ids, modes)
    summary["not_run"] = not_run
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (args.out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    for mode, entry in summary["modes"].items():
        print(f"{mode}: {entry['counts']}")
    print(f"summary: {args.out / 'summary.md'}")
    return 1 if not_run else 0


if __name__ == "__main__":
    sys.exit(main())
