"""Lightning's checkpoint dict, rebuilt from what the engine stores, as plain data (no Lightning import).

The Lightning adapter saves a checkpoint dict split in two (``lightning_resilience.lightning_state``): the part
every rank shares, and each rank's own data loader state under ``__rank<r>__/``. A ``.ckpt`` file holds one dict,
as Lightning writes it: the shared part with rank 0's loader state put back. Nothing here needs Lightning, so
the names the adapter writes after a commit and ``resilience export --format lightning`` build the same dict,
and the export works on a machine that has only the engine (a converter box, an inference image).
"""

from __future__ import annotations

from typing import Any

LOADER_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")
# Top-level keys that only training needs: a weights-only save (``save_weights_only=True``) leaves them out, and
# so does Lightning's precision plugin state, kept under the plugin's class name (``MixedPrecision``).
TRAINING_ONLY = ("optimizer_states", "lr_schedulers", "callbacks")
PRECISION_SUFFIX = "Precision"


def is_weights_only(checkpoint: dict[str, Any]) -> bool:
    return not any(key in checkpoint for key in TRAINING_ONLY)


def weights_only_keys(keys: list[str]) -> list[str]:
    """The top-level keys a weights-only save of a checkpoint with ``keys`` keeps, in order."""
    return [key for key in keys if key not in TRAINING_ONLY and not key.endswith(PRECISION_SUFFIX)]


def split_loaders(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(``checkpoint`` without the loader states, the loader states): what :func:`merge_checkpoint` undoes.

    The caller's dict is not modified: only the dicts along the loader states' path are copied.
    """
    shared = dict(checkpoint)
    node: dict[str, Any] = shared
    for key in LOADER_PATH[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            return shared, None
        node[key] = node = dict(child)
    return shared, node.pop(LOADER_PATH[-1], None)


def merge_checkpoint(shared: dict[str, Any], rank_state: dict[str, Any] | None) -> dict[str, Any]:
    """Put this rank's loader states back where Lightning looks for them."""
    if not rank_state or rank_state.get("combined_loader") is None:
        return shared
    loaders = rank_state["combined_loader"]
    if saved_at_epoch_end(shared):
        loaders = [_finished(state) for state in loaders]
    node = shared
    for key in LOADER_PATH[:-1]:
        node = node.setdefault(key, {})
    node[LOADER_PATH[-1]] = loaders
    return shared


def as_name(shared: dict[str, Any], rank0_state: dict[str, Any] | None, keys: list[str]) -> dict[str, Any]:
    """The dict a ``.ckpt`` file holds, as Lightning would have written it: rank 0's loader state, and only
    the top-level keys the save asked for (a weights-only save asks for fewer)."""
    checkpoint = merge_checkpoint(dict(shared), rank0_state)
    return {key: checkpoint[key] for key in keys if key in checkpoint}


def _finished(state: Any) -> Any:
    """A StatefulDataLoader state taken after an epoch's last batch, marked as the end of that epoch.

    Lightning never asks a sized loader for one batch too many, so the saved iterator does not know it is
    exhausted: restored as is, it yields an empty epoch first (shifting epoch numbers and per-epoch
    schedules), and a ``StatefulDistributedSampler`` carries its position into the next epoch. Marked as
    finished, the loader starts the next epoch afresh, keeping the sampler's generator state.
    """
    if not isinstance(state, dict) or "_iterator_finished" not in state:
        return state

    def rewind(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: 0 if k in ("yielded", "samples_yielded") and isinstance(v, int) else rewind(v)
                for k, v in node.items()
            }
        return node

    return {**rewind(state), "_iterator_finished": True}


def saved_at_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken after the last batch of an epoch."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", False))
