"""A committed step seen as a plain DCP checkpoint under other keys, sharing the step's shard files.

Tools outside the pack read DCP checkpoints in a key layout of their own: Lightning's sharded checkpoints keep
``state_dict.<fqn>`` and ``optimizer_0.state.<fqn>.exp_avg``, with every non-tensor leaf (learning rates,
betas, parameter names) a pickled entry of DCP's. The engine's step keeps its own keys and no pickled entries
(its trust model). A view is a directory that such a tool reads as its own:

* hard links to the step's shard files (no tensor byte is written again, and the data outlives the step when
  retention deletes it; across file systems, where links cannot go, the files are copied);
* a ``.metadata`` that maps the tool's keys onto the same chunks of those files;
* ``__objects.distcp`` with the view's non-tensor leaves, pickled the way DCP pickles them.

The view is for the tool's loader, with the tool's trust model; the engine never reads one.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from resilience.storage.catalog import Entry
from resilience.storage.layout import DCP_METADATA

log = logging.getLogger(__name__)
OBJECTS_FILE = "__objects.distcp"


def placeholders(metadata: Metadata) -> dict[str, torch.Tensor]:
    """One meta tensor (no memory) per tensor key of a step: stands in for it while its trees are rebuilt."""
    return {
        key: torch.empty(md.size, dtype=md.properties.dtype, device="meta")
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def write_view(
    entry: Entry,
    metadata: Metadata,
    tree: Mapping[str, Any],
    stand_ins: Mapping[str, torch.Tensor],
    directory: str,
    *,
    fsync: bool = True,
) -> None:
    """Write into the (new, empty) ``directory`` the view of ``entry`` whose layout is ``tree``.

    ``tree`` is the nested state as the tool would have saved it, its tensors being the ``stand_ins`` (from
    :func:`placeholders` of ``metadata``) of the step's tensors; DCP flattens it as its own save would, so its
    keys are the tool's. Everything else in ``tree`` is written as a pickled object.
    """
    flat, paths = flatten_state_dict(dict(tree))
    key_of = {id(tensor): key for key, tensor in stand_ins.items()}
    chunks: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(index.fqn, []).append((index, info))
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    objects = io.BytesIO()
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            key = key_of.get(id(value))
            if key is None:
                raise ValueError(f"{fqn} holds a tensor that is not one of the step's: a view can only share shards")
            entries[fqn] = metadata.state_dict_metadata[key]
            for index, info in chunks[key]:
                storage[MetadataIndex(fqn, index.offset, index.index)] = info
        else:
            start = objects.tell()
            torch.save(value, objects)
            entries[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = _StorageInfo(OBJECTS_FILE, start, objects.tell() - start)
    for name in sorted({info.relative_path for info in storage.values()} - {OBJECTS_FILE}):
        _link(f"{entry.path}/{name}", os.path.join(directory, name))
    _write(os.path.join(directory, OBJECTS_FILE), objects.getvalue(), fsync)
    view = Metadata(entries, planner_data=paths, storage_data=storage, version=metadata.version)
    _write(os.path.join(directory, DCP_METADATA), pickle.dumps(view), fsync)


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        log.info("cannot hard-link %s into %s (%s): copying it", source, os.path.dirname(target), exc.strerror)
        shutil.copyfile(source, target)


def _write(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as stream:
        stream.write(data)
        if fsync:
            stream.flush()
            os.fsync(stream.fileno())
