"""Upload to S3: the engine's durable tier against ``s3fs`` ``put`` of the same files, on moto's server.

moto's S3 server runs as its own process on 127.0.0.1 (``tests/helpers.py::MotoServer``). Turns alternate:
ours saves the state (8 x Linear(w, w) + Adam) and its uploader copies the committed local checkpoint to
``s3://bench/ours/step-N/`` and commits it there with a manifest (time: from the start of the upload to the
durable commit, as the engine records it); then ``S3FileSystem.put(dir, recursive=True)`` uploads that same
committed directory (the same bytes, manifest included) to a fresh prefix, which is deleted afterwards.
The default size is 0.4 GB, not 1.6: moto keeps every object in its own memory and does not hand it back
after deletes, and uploads on loopback here run at about 50 MB/s.

    .venv/bin/python -m benchmarks.bench_s3 [--size-gb 0.4] [--repeats 2] [--dir DIR]
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.common import (
    LAYERS,
    Report,
    Sample,
    Stats,
    alternate,
    build,
    column,
    model_state,
    now,
    parse,
    parser,
    ratio,
    scratch,
    width_for,
)
from resilience import CheckpointConfig, CheckpointManager
from tests.helpers import S3_ENV, MotoServer

BUCKET = "bench"
OURS, S3FS = "ours: durable tier upload + commit", "s3fs S3FileSystem.put(recursive=True)"


def main() -> None:
    import s3fs

    args = parse(parser(__doc__, size_gb=0.4, repeats=2))
    os.environ.update(S3_ENV)
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width)
    report = Report(
        "Upload to S3 (moto on loopback) (item 7)",
        f"{LAYERS} x Linear({width}, {width}) + Adam = {size / 1e9:.2f} GB; moto server process on 127.0.0.1; "
        f"{args.repeats} rounds after a warm-up round, in rotating order; median [IQR]",
    )
    server = MotoServer().start()
    uploaded: list[int] = []
    try:
        options = {"endpoint_url": server.endpoint}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir(BUCKET)
        with scratch(args.dir, "s3") as root:
            config = CheckpointConfig(
                local_root=root / "local", durable_url=f"s3://{BUCKET}/ours", storage_options=options, keep_last=2
            )
            with CheckpointManager(config) as manager:
                step = 0

                def ours() -> Sample:
                    nonlocal step
                    step += 1
                    handle = manager.save(step, model_state(model, optimizer))
                    assert handle is not None
                    handle.durable.result()
                    uploaded.append(handle.nbytes)
                    return {"s": handle.timings["upload_s"]}

                def plain() -> Sample:
                    """Upload the newest committed directory, the one ours uploaded last."""
                    local = Path(config.local_root) / f"step-{step}"
                    target = f"{BUCKET}/plain/step-{step}"
                    start = now()
                    fs.put(str(local), target, recursive=True)
                    elapsed = now() - start
                    fs.rm(target, recursive=True)
                    return {"s": elapsed}

                # ours goes first in the warm-up round, so there is a committed directory from then on
                samples = alternate({OURS: ours, S3FS: plain}, args.repeats)
    finally:
        server.stop()

    gb = Stats.of(uploaded).median / 1e9
    baseline = column(samples[S3FS], "s").median
    report.table(
        ["upload", "seconds", "MB/s", "x s3fs put"],
        [
            [
                name,
                column(rows, "s").fmt(2),
                f"{1e3 * gb / column(rows, 's').median:.0f}",
                f"{ratio(column(rows, 's').median, baseline):.2f}",
            ]
            for name, rows in samples.items()
        ],
    )
    report.add(
        f"- {gb:.3f} GB per checkpoint (the committed directory: DCP shard, metadata, state skeleton, "
        "manifest). Ours writes its manifest last, after every file is in place, and retries failed "
        "transfers; s3fs put is the bare transfer."
    )
    report.print()


if __name__ == "__main__":
    main()
