"""The ``resilience`` command: look at and check checkpoints without starting a training job.

Exit codes (also in ``resilience --help``): 0 success; 1 a check failed (a checkpoint does not verify, or a
step to upload is not committed); 2 usage error (bad arguments); 3 nothing found where a checkpoint root or a
run was named; 4 any other error (unreadable storage, bad settings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from resilience import __version__
from resilience.errors import CorruptCheckpointError, NoCheckpointError, ResilienceError
from resilience.progress import size_text
from resilience.storage import catalog
from resilience.storage.tiers import DurableTier, Tier

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_ERROR = 0, 1, 2, 3, 4
EXIT_CODES = (
    "exit codes: 0 success; 1 a check failed; 2 usage error; 3 no checkpoint root or run found there; "
    "4 other error (storage, settings)"
)


class NotFound(ResilienceError):
    """A named root or run does not exist (exit code 3)."""


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


def _tiers(args: argparse.Namespace) -> list[tuple[Tier, int | None]]:
    """Each root as (tier, step): a ``step-<N>`` directory stands for that step of its parent root."""
    options = _storage_options(args.storage_option)
    return [catalog.open_root(root, options) for root in args.roots]


def _entries(args: argparse.Namespace) -> list[tuple[Tier, catalog.Entry]]:
    return [
        (tier, entry)
        for tier, only in _tiers(args)
        for entry in catalog.scan(tier)
        if only is None or entry.step == only
    ]


def cmd_ls(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    scanned = [(tier, [e for e in catalog.scan(tier) if only is None or e.step == only]) for tier, only in _tiers(args)]
    empty = [tier for tier, entries in scanned if not entries]
    for tier, entry in [(tier, entry) for tier, entries in scanned for entry in entries]:
        manifest = entry.manifest
        status, problem = _status(entry)
        rows.append(
            {
                "step": entry.step,
                "status": status,
                "committed": manifest is not None,
                "scope": None if manifest is None else ("all ranks" if manifest.is_global else "node"),
                "world_size": None if manifest is None else manifest.world_size,
                "bytes": sum(tier.file_sizes(entry.path).values()) if manifest is None else manifest.total_bytes,
                "created": None if manifest is None else _iso(manifest.created_unix),
                "tier": tier.name,
                "path": tier.display(entry.path),
                "problem": problem,
            }
        )
    rows.sort(key=lambda r: (-r["step"], r["tier"]))
    if args.json:
        print(json.dumps(rows, indent=1))
    if not rows:  # a run's folder instead of its checkpoint root, most often: say where the roots are
        raise NotFound(" ".join(_no_checkpoints(tier) for tier in empty))
    for tier in empty:  # one root of several is empty (a durable URL nothing was uploaded to yet)
        print(f"note: {_no_checkpoints(tier)}", file=sys.stderr)
    if args.json:
        return EXIT_OK
    print(f"{'STEP':>8}  {'STATUS':<11}  {'WORLD':>5}  {'SIZE':>10}  {'CREATED':<20}  {'TIER':<7}  PATH")
    for r in rows:
        print(
            f"{r['step']:>8}  {r['status']:<11}  {r['world_size'] or '-':>5}  {size_text(r['bytes']):>10}  "
            f"{r['created'] or '-':<20}  {r['tier']:<7}  {r['path']}" + (f"  ({r['problem']})" if r["problem"] else "")
        )
    return EXIT_OK


def _status(entry: catalog.Entry) -> tuple[str, str | None]:
    """A row's status and problem: ``incomplete`` (no valid manifest), ``damaged`` (a file the manifest lists is
    missing or at another size: one listing tells, with no checksum), or ``committed``."""
    if entry.manifest is None:
        return "incomplete", entry.problem
    found = catalog.damage(entry)
    if found is not None:
        item, what = found
        return "damaged", f"file {item.path} {what}"
    return "committed", None


def _no_checkpoints(tier: Tier) -> str:
    """Why ``tier`` lists nothing, and the checkpoint roots found below it, with the command that lists them."""
    where = tier.display(tier.root)
    below = catalog.roots_below(tier)
    if not below:
        return (
            f"no checkpoints in {where}: no step-<N> folder there or up to {catalog.ROOTS_BELOW_DEPTH} levels below; "
            "give a checkpoint root (the local_root or durable_url of a run)."
        )
    shown = ", ".join(f"{path} ({n} step{'' if n == 1 else 's'})" for path, n in below[:5])
    more = f" and {len(below) - 5} more" if len(below) > 5 else ""
    return f"no checkpoints in {where}; checkpoint roots below it: {shown}{more}. Run: resilience ls {below[0][0]}"


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every committed step; a folder without a manifest is a save or upload that has not finished (or
    never will): it is listed, not failed, since there is nothing it claims to hold that could be checked."""
    found = [entry for _, entry in _entries(args)]
    if args.step is not None:
        found = [e for e in found if e.step == args.step]
    unfinished = [e for e in found if e.problem == catalog.NOT_COMMITTED]
    for entry in unfinished:
        print(f"SKIP {entry.where()}: {catalog.NOT_COMMITTED}: a save or upload that did not finish, not a checkpoint")
    entries = [e for e in found if e.problem != catalog.NOT_COMMITTED]
    if not entries:
        what = f"checkpoint of step {args.step}" if args.step is not None else "checkpoints"
        print(f"FAIL no committed {what} under {', '.join(args.roots)}")
        return EXIT_NOT_FOUND
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
        print(f"OK   {entry.where()}: {len(entry.manifest.files)} files, {size_text(entry.manifest.total_bytes)}")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from resilience.goodput.ledger import ledger_dir
    from resilience.goodput.report import run_report  # keeps `ls` and `verify` from loading the report code

    run_dir = args.run_dir
    if not os.path.isdir(run_dir) or not (
        any(ledger_dir(run_dir).glob("incarnation-*.jsonl")) or any(Path(run_dir).glob("incarnation-*.jsonl"))
    ):
        raise NotFound(f"no goodput ledger under {run_dir}: give the run directory that holds goodput/")
    return run_report(args.run_dir, as_json=args.json, plot=args.plot)


def cmd_upload(args: argparse.Namespace) -> int:
    """Upload committed local checkpoints the durable tier lacks (e.g. when a crash cut an upload short)."""
    from resilience.persist.transfer import RetryPolicy, push_step

    local, only = catalog.open_root(args.root)
    if args.step is None:
        args.step = only  # a step-<N> folder names that step
    durable = DurableTier(args.url, _storage_options(args.storage_option), setting="URL")
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
        return EXIT_OK if args.step in there else EXIT_FAILED
    for entry in sorted(todo, key=lambda e: e.step):
        assert entry.manifest is not None
        total = entry.manifest.total_bytes
        on_bytes = _Counter(total, _progress_printer(f"upload {entry.where()}") if args.progress else None)
        policy = RetryPolicy(args.retries)
        push_step(local, durable, entry, concurrency=args.concurrency, policy=policy, on_bytes=on_bytes)
        print(
            f"OK   step {entry.step} committed in {durable.display(durable.step_path(entry.step))}: {size_text(total)}"
        )
    if not todo:
        print(f"nothing to upload: every committed checkpoint under {local.url} is already in {durable.url}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write one committed step as a Lightning .ckpt, a torch.save state dict or safetensors, verified first."""
    from resilience.formats.export import DTYPES, export  # keeps torch out of `ls` and `verify`

    options = _storage_options(args.storage_option)
    on_bytes = _Counter(0, _progress_printer(f"tensors read for {args.out}") if args.progress else None)
    try:
        done = export(
            args.root,
            args.out,
            format=args.format,
            step=args.step,
            weights_only=args.weights_only,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            model=args.model,
            weights=args.weights,
            storage_options=options,
            out_storage_options=options,
            max_shard_bytes=_bytes(args.max_shard_size),
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            on_bytes=on_bytes,
        )
    except CorruptCheckpointError as exc:  # a check failed: nothing was written
        print(f"FAIL {exc}")
        return EXIT_FAILED
    on_bytes.finish()
    if done.note:
        print(f"note: {done.note}", file=sys.stderr)
    files = ", ".join(done.files)
    print(f"OK   step {done.step} -> {files} ({done.format}, {size_text(done.tensor_bytes)} of tensors)")
    return EXIT_OK


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)?\s*$", re.IGNORECASE)


def _bytes(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes, read as ``save_pretrained``'s ``max_shard_size``."""
    match = _SIZE.match(text)
    if not match:
        raise SystemExit(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    unit = (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(match.group(1)) * ((1024 if "I" in unit else 1000) ** power))


class _Counter:
    """Adds up bytes as they are reported and shows the running figure; :meth:`finish` shows the last one."""

    def __init__(self, total: int, show: Callable[..., None] | None):
        self.total, self.show, self.done = total, show, 0

    def __call__(self, delta: int) -> None:
        self.done += delta
        if self.show is not None:
            self.show(self.done, self.total)

    def finish(self) -> None:
        if self.show is not None and self.done:
            self.show(self.done, self.total, last=True)


def _progress_printer(label: str) -> Callable[..., None]:
    """Prints progress at most twice a second, and the ``last`` figure; a total of 0 means not known beforehand
    (bytes only). Nothing before the first byte ("0 B" tells nothing), and no line the same as the one before."""
    last_t, shown = [0.0], [""]

    def show(done: int, total: int, *, last: bool = False) -> None:
        now = time.monotonic()
        if not done or not (last or now - last_t[0] >= 0.5 or done == total):
            return
        text = f"{100.0 * done / total:5.1f}% ({size_text(done)} of {size_text(total)})" if total else size_text(done)
        if text != shown[0]:
            last_t[0], shown[0] = now, text
            print(f"  {label}: {text}", file=sys.stderr, flush=True)

    return show


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _add_export(sub: Any) -> None:
    """``resilience export``'s options: the most of any command."""
    export = sub.add_parser(
        "export", help="write a committed step as a Lightning .ckpt, a torch.save state dict or safetensors"
    )
    export.add_argument("root", metavar="ROOT", help="checkpoint root (directory or fsspec URL), or a step-<N> folder")
    export.add_argument(
        "out",
        metavar="OUT",
        help="file to write; safetensors: FILE.safetensors is one file, any other name a directory in "
        "save_pretrained's layout (shards and an index above --max-shard-size)",
    )
    export.add_argument("--format", required=True, choices=("lightning", "torch", "safetensors"))
    export.add_argument("--step", type=int, help="this step (default: the newest committed one)")
    export.add_argument("--weights-only", action="store_true", help="leave out optimizer, scheduler, callback state")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast the model's floating-point weights")
    export.add_argument("--model", type=int, default=0, help="Accelerate: which prepared model (prepare order)")
    export.add_argument("--weights", metavar="PATH", help="path of the model's state dict in the saved state (a/b/c)")
    export.add_argument(
        "--max-shard-size", default="5GB", help="safetensors: split files above this, into a directory (default 5GB)"
    )
    export.add_argument("--overwrite", action="store_true", help="replace what an earlier export wrote at OUT")
    export.add_argument("--allow-pickle", action="store_true", help="decode state values stored as pickles")
    export.add_argument("--progress", action="store_true", help="show tensor bytes read on stderr")
    export.add_argument(
        "--storage-option", action="append", default=[], metavar="NAME=VALUE", help="fsspec option for URLs"
    )
    export.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resilience",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (training-resilience)")
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

    ls = sub.add_parser(
        "ls", help="list checkpoints: step, status (committed, damaged, incomplete), world size, size, time, tier"
    )
    with_roots(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    verify = sub.add_parser(
        "verify",
        help="check committed steps against their manifests (unfinished ones are listed); exit 0 if all verify",
    )
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

    _add_export(sub)

    report = sub.add_parser("report", help="goodput of a run: where its wall time went, across restarts")
    report.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding goodput/ (or that folder itself)")
    report.add_argument("--json", action="store_true", help="machine-readable summary")
    report.add_argument("--plot", metavar="FILE.png", help="also write a timeline picture (needs matplotlib)")
    report.set_defaults(func=cmd_report)

    launch = sub.add_parser(
        "launch",
        help="run a training script's ranks on this node, replacing a lost rank in place (exits with the job's code)",
    )
    from resilience.recovery.launch_config import add_arguments

    add_arguments(launch)
    launch.set_defaults(func=cmd_launch)

    return parser


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the job, then leave at once with its code. Every rank has ended by then and nothing of the user's runs
    in this process, so the interpreter's teardown (0.4 s with torch imported, on 2 cores) would only delay a
    requeued job's next start: the logs and streams are flushed, the rest goes with the process."""
    from resilience.recovery.launcher import launch

    code = launch(args)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 here (argparse)
    try:
        return int(args.func(args))
    except (NotFound, NoCheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except ResilienceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `resilience report --json | head`: the reader left, which is fine
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
