from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers import S3_ENV, MotoServer

FAST_EXIT = os.path.join(os.path.dirname(__file__), "fast_exit")
# every process the tests start (workers, launchers and the ranks they start) exits without the interpreter's
# last garbage collections: see tests/fast_exit/sitecustomize.py
if FAST_EXIT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [FAST_EXIT, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One real S3-protocol server (moto) per test session, on loopback."""
    for name, value in S3_ENV.items():
        os.environ[name] = value
    os.environ.pop("AWS_PROFILE", None)
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoServer) -> Iterator[dict[str, object]]:
    """A fresh bucket on the moto server; yields the URL root and storage options for it."""
    import s3fs

    moto_server.reset()
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": moto_server.endpoint}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("ckpt-bucket")
    yield {"url": "s3://ckpt-bucket/run", "options": options, "fs": fs, "server": moto_server}
    s3fs.S3FileSystem.clear_instance_cache()
