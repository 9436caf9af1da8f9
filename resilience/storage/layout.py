"""Every name the engine gives a file or directory in a checkpoint tier, in one place.

A tier (the local root, or the durable URL) holds::

    step-<N>/                      one checkpoint; counts only once manifest.json is in it
        __<rank>_<i>.distcp        DCP shards
        .metadata                  DCP's global metadata (a pickle, checked before it is read)
        state.json                 the non-tensor skeleton of the shared state
        packs.json                 (steps of earlier releases) where each packed small tensor lies in __packs__/<i>
        rank-<r>.json              each rank's own state (RNG, data position)
        .writer.json               who is writing it, until the commit (in the durable tier: who uploads it)
        .proof-<rank>.json         what rank r hashed at commit, with inode and times (local tier, never uploaded)
        manifest.json              the commit record, written last
    quarantine/step-<N>-<time>/    local copies found corrupt (never deleted automatically)
    superseded/step-<N>-<time>/    local checkpoints of an abandoned branch (a resume from an older step)
    .owners/<host>.<pid>.<id>.json one record per live job that writes to this root (local tier)
    .lease/<generation>.json|.beat who may write to this URL, and its beat (durable tier; resilience/storage/lease.py)

Readers never need anything but the step directories and their manifests.
"""

from __future__ import annotations

import re

STEP_PREFIX = "step-"
STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
STATE_FILE = "state.json"
PACKS_FILE = "packs.json"
# DCP keys of the flat byte buffers that earlier releases packed small plain tensors into
PACK_PREFIX = "__packs__/"
WRITER_FILE = ".writer.json"
PROOF_PREFIX = ".proof-"
QUARANTINE_DIR = "quarantine"
SUPERSEDED_DIR = "superseded"
OWNERS_DIR = ".owners"
LEASE_DIR = ".lease"
PROBE_PREFIX = ".write-probe-"
# Suffixes given to a durable manifest that is taken out of discovery (renaming the prefix would copy it all).
CORRUPT_MANIFEST = MANIFEST + ".corrupt-"
SUPERSEDED_MANIFEST = MANIFEST + ".superseded-"


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``step-<N>`` directory name, or None for any other name."""
    match = STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def rank_state_file(rank: int) -> str:
    return f"rank-{rank}.json"


def proof_file(rank: int) -> str:
    return f"{PROOF_PREFIX}{rank}.json"


def rank_prefix(rank: int) -> str:
    """Key prefix of a rank's own tensors: DCP would otherwise collapse equal keys of different ranks."""
    return f"__rank{rank}__/"


def aside_name(step: int, stamp: str) -> str:
    """Name of a step directory moved into ``quarantine/`` or ``superseded/``."""
    return f"{step_dirname(step)}-{stamp}"
