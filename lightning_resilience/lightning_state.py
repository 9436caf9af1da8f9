"""Lightning's checkpoint dict, split into what all ranks share and what each rank owns.

Lightning builds the checkpoint dict on every rank but historically writes only rank 0's, so the data loader
position of the other ranks is lost. Here the loader states (``loops.fit_loop.state_dict.combined_loader``)
and the RNG state go into the per-rank part; everything else is the shared part, identical across DDP ranks.
"""

from __future__ import annotations

from typing import Any

from resilience.rng import capture_rng

_LOADER_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")


def split_checkpoint(
    checkpoint: dict[str, Any], epoch_start_rng: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared state, this rank's state); the caller's dict is not modified.

    ``epoch_start_rng`` is the RNG state as the current epoch's data loader iterator was created; samplers
    that draw their shuffle seed from the global generator then (as Lightning's distributed sampler wrapper
    does) need it to replay the same order on resume.
    """
    shared = dict(checkpoint)
    loaders = None
    node: dict[str, Any] = shared
    for key in _LOADER_PATH[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            break
        child = dict(child)  # copy along the path only
        node[key] = child
        node = child
    else:
        loaders = node.pop(_LOADER_PATH[-1], None)
    rank_state = {"rng": capture_rng(), "epoch_start_rng": epoch_start_rng, "combined_loader": loaders}
    return shared, rank_state


def merge_checkpoint(shared: dict[str, Any], rank_state: dict[str, Any] | None) -> dict[str, Any]:
    """Put this rank's loader states back where Lightning looks for them."""
    if not rank_state or rank_state.get("combined_loader") is None:
        return shared
    node = shared
    for key in _LOADER_PATH[:-1]:
        node = node.setdefault(key, {})
    node[_LOADER_PATH[-1]] = rank_state["combined_loader"]
    return shared


def saved_at_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken after the last batch of an epoch."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", False))
