"""The ``resilience`` command: look at and check checkpoints without starting a training job."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilience import catalog
from resilience.errors import ResilienceError
from resilience.storage import Tier


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--storage-option {pair!r}: use NAME=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value
    return options


def _tiers(args: argparse.Namespace) -> list[Tier]:
    options = _storage_options(args.storage_option)
    tiers = []
    for root in args.roots:
        tier = Tier("local" if "://" not in root else "durable", root, options)
        tier.check_readable()
        tiers.append(tier)
    return tiers


def cmd_ls(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for tier in _tiers(args):
        for entry in catalog.scan(tier):
            manifest = entry.manifest
            rows.append(
                {
                    "step": entry.step,
                    "committed": manifest is not None,
                    "scope": None if manifest is None else ("all ranks" if manifest.is_global else "node"),
                    "world_size": None if manifest is None else manifest.world_size,
                    "bytes": sum(tier.file_sizes(entry.path).values()) if manifest is None else manifest.total_bytes,
                    "created": None if manifest is None else _iso(manifest.created_unix),
                    "tier": tier.name,
                    "path": tier.display(entry.path),
                    "problem": entry.problem,
                }
            )
    rows.sort(key=lambda r: (-r["step"], r["tier"]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no checkpoints found")
        return 0
    print(f"{'STEP':>8}  {'STATUS':<11}  {'WORLD':>5}  {'SIZE':>10}  {'CREATED':<20}  {'TIER':<7}  PATH")
    for r in rows:
        status = "committed" if r["committed"] else "incomplete"
        print(
            f"{r['step']:>8}  {status:<11}  {r['world_size'] or '-':>5}  {_size(r['bytes']):>10}  "
            f"{r['created'] or '-':<20}  {r['tier']:<7}  {r['path']}" + (f"  ({r['problem']})" if r["problem"] else "")
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    entries = [e for tier in _tiers(args) for e in catalog.scan(tier)]
    if args.step is not None:
        entries = [e for e in entries if e.step == args.step]
        if not entries:
            print(f"FAIL no checkpoint of step {args.step} under {', '.join(args.roots)}")
            return 1
    elif not entries:
        print(f"FAIL no checkpoints under {', '.join(args.roots)}")
        return 1
    failed = 0
    for entry in entries:
        progress = _progress_printer(entry.where()) if args.progress else None
        try:
            catalog.verify(entry, full=not args.quick, progress=progress)
        except ResilienceError as exc:
            failed += 1
            print(f"FAIL {exc}")
            continue
        assert entry.manifest is not None
        print(f"OK   {entry.where()}: {len(entry.manifest.files)} files, {_size(entry.manifest.total_bytes)}")
    return 1 if failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from resilience.goodput.report import run_report  # keeps `ls` and `verify` from loading the report code

    return run_report(args.run_dir, as_json=args.json, plot=args.plot)


def cmd_upload(args: argparse.Namespace) -> int:
    """Upload committed local checkpoints the durable tier lacks (e.g. when a crash cut an upload short)."""
    from resilience.manifest import MANIFEST_NAME
    from resilience.transfer import RetryPolicy, commit_durable, upload_files

    local = Tier("local", args.root)
    durable = Tier("durable", args.url, _storage_options(args.storage_option))
    durable.check_writable()
    there = {e.step for e in catalog.scan(durable) if e.committed}
    todo = [
        e
        for e in catalog.scan(local)
        if e.manifest is not None
        and e.manifest.is_global
        and e.step not in there
        and (args.step is None or e.step == args.step)
    ]
    if args.step is not None and not todo:
        state = "is already committed there" if args.step in there else "is not a committed checkpoint here"
        print(f"step {args.step} {state}")
        return 0 if args.step in there else 1
    for entry in sorted(todo, key=lambda e: e.step):
        assert entry.manifest is not None
        catalog.verify(entry, full=True)  # never spread a corrupt checkpoint to the durable tier
        total = entry.manifest.total_bytes
        on_bytes = _counter(total, _progress_printer(f"upload {entry.where()}") if args.progress else None)
        upload_files(
            local,
            durable,
            entry.step,
            entry.manifest.files,
            concurrency=args.concurrency,
            policy=RetryPolicy(args.retries),
            on_bytes=on_bytes,
        )
        commit_durable(
            durable, entry.step, local.read_bytes(f"{entry.path}/{MANIFEST_NAME}"), RetryPolicy(args.retries)
        )
        print(f"OK   step {entry.step} committed in {durable.display(durable.step_path(entry.step))}: {_size(total)}")
    if not todo:
        print(f"nothing to upload: every committed checkpoint under {local.url} is already in {durable.url}")
    return 0


def _counter(total: int, show: Callable[[int, int], None] | None) -> Callable[[int], None]:
    done = 0

    def count(delta: int) -> None:
        nonlocal done
        done += delta
        if show is not None:
            show(done, total)

    return count


def _progress_printer(label: str) -> Callable[[int, int], None]:
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or done == total:
            last[0] = now
            pct = 100.0 * done / total if total else 100.0
            print(f"  {label}: {pct:5.1f}% ({_size(done)} of {_size(total)})", file=sys.stderr, flush=True)

    return show


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilience", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_roots(p: argparse.ArgumentParser) -> None:
        p.add_argument("roots", nargs="+", metavar="ROOT", help="local checkpoint directory or fsspec URL")
        p.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="fsspec option for URL roots (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
        )

    ls = sub.add_parser("ls", help="list checkpoints: step, committed or not, world size, size, time, tier")
    with_roots(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    verify = sub.add_parser("verify", help="check files against manifests; exit 0 only if all verify")
    with_roots(verify)
    verify.add_argument("--step", type=int, help="only this step")
    verify.add_argument("--quick", action="store_true", help="sizes only for shards (checksums of small files)")
    verify.add_argument("--progress", action="store_true", help="show checksum progress on stderr")
    verify.set_defaults(func=cmd_verify)

    upload = sub.add_parser("upload", help="upload committed local checkpoints the durable URL lacks, manifest last")
    upload.add_argument("root", metavar="ROOT", help="local checkpoint directory")
    upload.add_argument("url", metavar="URL", help="durable fsspec URL, e.g. s3://bucket/run")
    upload.add_argument("--step", type=int, help="only this step")
    upload.add_argument("--concurrency", type=int, default=8, help="files in flight at once")
    upload.add_argument("--retries", type=int, default=5, help="retries per file, with exponential backoff")
    upload.add_argument("--progress", action="store_true", help="show bytes sent on stderr")
    upload.add_argument(
        "--storage-option", action="append", default=[], metavar="NAME=VALUE", help="fsspec option for URL"
    )
    upload.set_defaults(func=cmd_upload)

    report = sub.add_parser("report", help="goodput of a run: where its wall time went, across restarts")
    report.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding goodput/ (or that folder itself)")
    report.add_argument("--json", action="store_true", help="machine-readable summary")
    report.add_argument("--plot", metavar="FILE.png", help="also write a timeline picture (needs matplotlib)")
    report.set_defaults(func=cmd_report)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ResilienceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
