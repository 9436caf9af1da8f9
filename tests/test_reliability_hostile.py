"""Storage as hostile input: manifests, DCP's pickled ``.metadata``, state skeletons, pickled values, credentials.

The trust model these tests pin down is written up in docs/FORMAT.md ("Trust model"): the manifest is validated JSON
and is read first; every other small file must match its checksum before it is parsed; ``.metadata`` goes
through an allow-list unpickler; nothing else from storage is unpickled unless the user opts in.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pickle
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex

from resilience import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from resilience.cli import main as cli
from resilience.goodput.ledger import GoodputLedger
from resilience.goodput.telemetry import CheckpointTelemetry
from resilience.storage.catalog import scan
from resilience.storage.tiers import LocalTier
from tests.helpers import edit_manifest, reseal
from tests.s3_proxy import FaultProxy
from tests.test_engine_local import make_state, manager
from tests.test_reliability_s3 import client_options

ManifestMaker = Callable[[dict[str, Any]], bytes]


def with_file(**fields: object) -> ManifestMaker:
    def make(body: dict[str, Any]) -> bytes:
        body["files"][0].update(fields)
        return json.dumps(body).encode()

    return make


def with_top(**fields: object) -> ManifestMaker:
    def make(body: dict[str, Any]) -> bytes:
        body.update(fields)
        return json.dumps(body).encode()

    return make


def file_twice(body: dict[str, Any]) -> bytes:
    body["files"].append(dict(body["files"][0]))
    return json.dumps(body).encode()


def huge_integer(body: dict[str, Any]) -> bytes:
    return json.dumps({**body, "world_size": 0}).replace('"world_size": 0', '"world_size": ' + "9" * 5000).encode()


HOSTILE_MANIFESTS: dict[str, ManifestMaker] = {
    "path traversal": with_file(path="../../outside.bin"),
    "absolute path": with_file(path="/etc/passwd"),
    "traversal inside a path": with_file(path="sub/../../outside.bin"),
    "backslash path": with_file(path="..\\outside.bin"),
    "size beyond any disk": with_file(size=1 << 62),
    "negative size": with_file(size=-1),
    "size as a string": with_file(size="100"),
    "rank as a boolean": with_file(rank=True),
    "rank beyond the world size": with_file(rank=7),
    "unknown file kind": with_file(kind="exec"),
    "checksum not hex": with_file(xxh3_64="../../etc/passwd"),
    "files not a list": with_top(files={"__0_0.distcp": 1}),
    "step as a float": with_top(step=2.0),
    "absurd world size": with_top(world_size=1 << 40),
    "file listed twice": file_twice,
    "another format": with_top(format="pickle"),
    "future version": with_top(version=99),
    "integer of 5000 digits": huge_integer,
    "nested 100000 deep": lambda _: b"[" * 100_000 + b"]" * 100_000,
    "not utf-8": lambda _: b"\xff\xfe\x00{",
    "top level a list": lambda _: b"[]",
}


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with manager(root, keep_last=3) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
    return root


def assert_falls_back(root: Path, problem: str, target: object = None) -> None:
    """Loading sets the bad step 2 aside with a warning naming ``problem`` and restores step 1 instead."""
    with manager(root, keep_last=3) as m, pytest.warns(UserWarning, match=rf"Skipping step 2 .*{problem}"):
        restored = m.load(target)
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
    assert not (root / "step-2").exists() and len(list((root / "quarantine").iterdir())) == 1


@pytest.mark.parametrize("kind", list(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_refused_and_discovery_goes_on(
    two_steps: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = two_steps.parent / "outside.bin"
    outside.write_bytes(b"not part of any checkpoint")
    manifest = two_steps / "step-2" / "manifest.json"
    manifest.write_bytes(HOSTILE_MANIFESTS[kind](json.loads(manifest.read_bytes())))

    entry = next(e for e in scan(LocalTier(two_steps)) if e.step == 2)
    assert entry.manifest is None and entry.problem is not None and "is invalid" in entry.problem
    assert cli(["ls", str(two_steps), "--json"]) == 0
    assert cli(["verify", str(two_steps)]) == 1
    report = capsys.readouterr().out
    assert "FAIL step 2" in report and "is invalid" in report and "OK   step 1" in report
    with manager(two_steps, keep_last=3) as m, pytest.warns(UserWarning, match=r"Skipping step 2 .*is invalid"):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
    assert outside.read_bytes() == b"not part of any checkpoint"


class _Exploit:
    """Unpickling this calls ``function(argument)``: what a hostile pickle does."""

    def __init__(self, function: Callable[[str], object], argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.function, (self.argument,)


def exploits(marker: Path) -> dict[str, bytes]:
    import os

    command = f"touch {marker}"
    return {
        "os.system": pickle.dumps(_Exploit(os.system, command)),
        "builtins.eval": pickle.dumps(_Exploit(eval, f"__import__('os').system({command!r})")),
        "attribute path from an allowed class": (
            b"ctorch.distributed.checkpoint.metadata\nMetadata.__init__.__globals__\n."
        ),
        "torch.load": pickle.dumps(_Exploit(torch.load, str(marker))),
    }


@pytest.mark.parametrize(
    "payload", ["os.system", "builtins.eval", "attribute path from an allowed class", "torch.load"]
)
def test_malicious_dcp_metadata_with_a_matching_checksum_runs_nothing(
    two_steps: Path, tmp_path: Path, payload: str
) -> None:
    marker = tmp_path / "pwned"
    step_dir = two_steps / "step-2"
    (step_dir / ".metadata").write_bytes(exploits(marker)[payload])
    reseal(step_dir, ".metadata")  # someone who can write the storage can also rewrite the manifest
    assert cli(["verify", str(two_steps)]) == 0  # checksums prove integrity, not intent
    assert_falls_back(two_steps, "is not allowed in DCP")
    assert not marker.exists(), "the pickle ran code"


@pytest.mark.parametrize(
    ("skeleton", "problem"),
    [
        ({"model": {"$t": "tensor", "k": "no/such/tensor"}}, "no tensor 'no/such/tensor'"),
        ({"model": {"$t": "tuple"}}, "malformed"),
        ({"model": {"$t": "dtype", "v": "load"}}, "not a torch dtype"),
        ({"model": {"$t": "float", "v": "not a number"}}, "malformed"),
        ({"model": {"$t": "dict", "items": [[{"$t": "set", "v": []}, 1]]}}, "malformed"),
        ({"model": {"$t": "exec", "v": "rm -rf /"}}, "unknown value tag 'exec'"),
    ],
)
def test_malformed_state_skeleton_is_a_corrupt_checkpoint(two_steps: Path, skeleton: object, problem: str) -> None:
    step_dir = two_steps / "step-2"
    (step_dir / "state.json").write_text(json.dumps(skeleton))
    reseal(step_dir, "state.json")
    assert_falls_back(two_steps, re.escape(problem))


def test_pickled_values_load_only_with_the_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with manager(tmp_path / "ckpt") as m:
        m.save(1, {"w": torch.ones(3), "ratio": Fraction(1, 3)})
    with (
        manager(tmp_path / "ckpt") as m,
        pytest.raises(ConfigError, match=r"pickled fractions.Fraction.*allow_pickle"),
    ):
        m.load()
    with manager(tmp_path / "ckpt", allow_pickle=True) as m:
        restored = m.load()
    assert restored is not None and restored.state["ratio"] == Fraction(1, 3)

    import os

    step_dir = tmp_path / "ckpt" / "step-1"
    skeleton = json.loads((step_dir / "state.json").read_bytes())
    skeleton["ratio"]["b64"] = base64.b64encode(pickle.dumps(_Exploit(os.system, f"touch {marker}"))).decode()
    (step_dir / "state.json").write_text(json.dumps(skeleton))
    reseal(step_dir, "state.json")
    with manager(tmp_path / "ckpt") as m, pytest.raises(ConfigError, match="allow_pickle"):
        m.load()
    assert not marker.exists()
    with manager(tmp_path / "ckpt", allow_pickle=True) as m:
        m.load()  # what the opt-in means: a pickle from storage runs code
    assert marker.exists()


def test_manifest_extra_and_unknown_fields_do_not_break_discovery(two_steps: Path) -> None:
    def odd(body: dict[str, Any]) -> None:
        body["extra"] = ["not", "a", "map"]
        body["unexpected"] = {"$t": "pickle", "b64": "AAAA"}

    edit_manifest(two_steps / "step-2", odd)
    with manager(two_steps, keep_last=3) as m:
        restored = m.load()
    assert restored is not None and restored.step == 2 and restored.manifest.extra == {}


KEY, SECRET = "AKIARESILIENCETEST01", "s3cr3t/Never-Logged+0123456789abcdefghij"


def test_credentials_never_reach_logs_manifests_errors_or_reports(
    tmp_path: Path, s3: dict[str, object], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    server = s3["server"]
    proxy = FaultProxy(server.endpoint).start()  # type: ignore[attr-defined]
    options = {**client_options(proxy.endpoint), "key": KEY, "secret": SECRET}
    caplog.set_level(logging.DEBUG)
    run_dir = tmp_path / "run"
    ledger = GoodputLedger(run_dir)
    config = CheckpointConfig(
        run_dir / "ckpt",
        durable_url=str(s3["url"]),
        storage_options=options,
        upload_retries=2,
        upload_backoff_s=0.01,
        on_upload_error="warn",
    )
    texts: list[str] = [repr(config)]
    try:
        with CheckpointManager(config, listeners=[CheckpointTelemetry(ledger=ledger, sample_gpu=False)]) as m:
            assert m.durable is not None
            m.durable.fs.retries = 1
            texts.append(repr(m.durable))
            ledger.startup_done()
            m.save(1, make_state(1))
            assert m.wait(durable=True)
            ledger.step_end(1)
            proxy.inject("500", match="/step-2/", times=100)  # a failed upload: errors logged, ledgered, raised
            second = m.save(2, make_state(2))
            assert second is not None
            with pytest.raises(CheckpointError, match="Uploading the checkpoint failed") as failed:
                second.durable.result(60)
            texts.append(str(failed.value))
            ledger.step_end(2)
        ledger.end()
        proxy.stop()  # an unreachable store at start-up: the error names the URL, not the credentials
        with pytest.raises(ConfigError, match="not reachable") as unreachable:
            CheckpointManager(CheckpointConfig(tmp_path / "other", durable_url=str(s3["url"]), storage_options=options))
        texts.append(str(unreachable.value))
    finally:
        proxy.stop()

    cli_options = [f"--storage-option=endpoint_url={server.endpoint}", f"--storage-option=key={KEY}"]  # type: ignore[attr-defined]
    cli_options.append(f"--storage-option=secret={SECRET}")
    assert cli(["ls", str(s3["url"]), *cli_options]) == 0
    assert cli(["verify", str(s3["url"]), *cli_options]) == 0
    assert cli(["report", str(run_dir)]) == 0 and cli(["report", str(run_dir), "--json"]) == 0
    out = capsys.readouterr()
    assert "step-1" in out.out and "Goodput" in out.out
    texts += [out.out, out.err]
    texts += [
        p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")
    ]
    fs = s3["fs"]
    texts += [fs.cat_file(p).decode() for p in fs.find("ckpt-bucket/run") if p.endswith(".json")]  # type: ignore[attr-defined]
    assert len(texts) > 8
    for text in texts:
        assert SECRET not in text and KEY not in text, text
    for record in caplog.records:
        message = record.getMessage() + (record.exc_text or "")
        assert SECRET not in message, (record.name, message)
        # botocore's own wire-level DEBUG records carry the key id in the Authorization header; nothing else may
        assert KEY not in message or record.name.startswith(("botocore", "aiobotocore")), (record.name, message)


def tamper_metadata(step_dir: Path, change: Callable[[Metadata], None]) -> None:
    """Rewrite DCP's ``.metadata`` (read here with plain pickle: it is this test's own file) and reseal it."""
    path = step_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))
    reseal(step_dir, ".metadata")


def test_metadata_declaring_a_tensor_as_pickled_bytes_runs_nothing(two_steps: Path, tmp_path: Path) -> None:
    """DCP unpickles "bytes" entries with ``torch.load(weights_only=False)``: only tensors may be read."""
    import os

    marker = tmp_path / "pwned"
    step_dir = two_steps / "step-2"
    buffer = io.BytesIO()
    torch.save(_Exploit(os.system, f"touch {marker}"), buffer)  # what DCP's bytes reader hands to torch.load
    payload = buffer.getvalue()
    (step_dir / "__9_0.distcp").write_bytes(payload)

    def as_bytes(metadata: Metadata) -> None:
        metadata.state_dict_metadata["model/w"] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex("model/w")] = _StorageInfo("__9_0.distcp", 0, len(payload))

    tamper_metadata(step_dir, as_bytes)

    def list_it(body: dict[str, Any]) -> None:
        body["files"].append({**body["files"][0], "path": "__9_0.distcp", "rank": 0, "kind": "shard"})

    edit_manifest(step_dir, list_it)
    reseal(step_dir, "__9_0.distcp")
    assert_falls_back(two_steps, "BytesStorageMetadata is not", make_state(0))
    assert not marker.exists(), "a pickle from a shard ran code"


def read_elsewhere(metadata: Metadata) -> None:
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = _StorageInfo(f"../step-1/{info.relative_path}", info.offset, info.length)


def not_a_tensor(metadata: Metadata) -> None:
    metadata.state_dict_metadata["model/w"] = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))


@pytest.mark.parametrize(
    ("tampering", "problem"),
    [
        (read_elsewhere, "points at '../step-1/__0_0.distcp', which is not a shard the manifest lists"),
        (not_a_tensor, "'model/w' is a ChunkStorageMetadata, not a tensor"),
    ],
)
def test_metadata_that_reaches_beyond_the_checkpoint_is_refused(
    two_steps: Path, tampering: Callable[[Metadata], None], problem: str
) -> None:
    tamper_metadata(two_steps / "step-2", tampering)  # read_elsewhere: step 1's values would load as step 2's
    assert_falls_back(two_steps, re.escape(problem), make_state(0))
