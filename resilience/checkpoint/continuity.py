"""Run continuity: a resumed run carries on the run its user sees, not only the training state.

A relaunch that resumes at step N would otherwise log into a new logger version (``version_1``) beside the
saved run's, and the saved run's metric rows of the steps after N (lost, and logged again) would stand beside
the new ones. So each save records its loggers' versions in the manifest (:func:`logger_versions`), a resume
gives each logger its saved version back (:func:`continue_versions`), and of the saved run's metrics file it
keeps only the rows the resumed run does not log again (:func:`kept_rows`).

Loggers are taken as they come: objects with a ``version`` (a number, or a tracking service's run id); those
that number their versions keep the one chosen in ``_version``, None until they choose (Lightning's
``CSVLogger`` and ``TensorBoardLogger`` do). Nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Iterable, Iterator
from typing import Any


def logger_versions(loggers: Iterable[Any]) -> list[int | str | None]:
    """Each logger's version (run id) as far as JSON can hold it, in the loggers' order."""
    versions: list[int | str | None] = []
    for logger in loggers:
        try:
            version = logger.version
        except Exception:  # a logger that needs its service for this: no version to continue
            version = None
        versions.append(version if isinstance(version, (int, str)) else None)
    return versions


def continue_versions(loggers: Iterable[Any], versions: list[Any]) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Give each logger that has not chosen a version the one it had in the saved run.

    Returns the loggers that took their saved version, and (logger, saved version) for each that logs under
    another: one whose version is a run id can only be given one when it is made, which the adapter tells its
    user how to do. Loggers added or removed since the save: the first ones are matched.
    """
    took, others = [], []
    for logger, version in zip(loggers, versions, strict=False):
        if version is None:
            continue
        if getattr(logger, "_version", version) is None:
            logger._version = version
            took.append(logger)
        elif logger.version != version:
            others.append((logger, version))
    return took, others


@contextlib.contextmanager
def kept_rows(path: str, step: int) -> Iterator[list[dict[str, str]]]:
    """The rows of the metrics CSV at ``path`` that a run resumed at ``step`` keeps, for the caller to write back.

    Kept: the rows of the steps before ``step``, and the commit of that step; dropped: those of the lost steps
    after it (they are logged again), and each row's empty cells. Inside, the file is out of the way of a writer
    that deletes what it finds when it opens the path; it is removed once the block ends without an error (after
    one, it stays beside the path, with the saved run's rows).
    """
    aside = f"{path}.resumed-{os.getpid()}"
    os.replace(path, aside)
    with open(aside, newline="") as stream:
        rows = [
            {key: value for key, value in row.items() if value != ""}
            for row in csv.DictReader(stream)
            if float(row.get("step") or 0) < step or 0 < float(row.get("checkpoint/committed_step") or 0) <= step
        ]
    yield rows
    os.remove(aside)
