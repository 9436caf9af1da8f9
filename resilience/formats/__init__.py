"""File formats the engine writes from a committed step without the framework that defined them.

``lightning_ckpt`` is Lightning's checkpoint dict as plain data, ``torch_file`` a ``torch.save`` file written
one tensor at a time, ``safetensors_file`` Hugging Face's safetensors layout. None of them imports Lightning
or Accelerate: ``resilience export`` runs where only the engine is installed.
"""

from __future__ import annotations

import torch

from resilience.errors import ConfigError


def raw_bytes(value: torch.Tensor | torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU tensor in row-major order (or of a storage), without a copy when it is contiguous."""
    if isinstance(value, torch.UntypedStorage):
        value = torch.empty(0, dtype=torch.uint8).set_(value)
    flat = value.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


# The suffixes that name each format's single file: a name of another format's is a mistake worth stopping.
SUFFIXES = {"lightning": (".ckpt",), "torch": (".pt", ".pth", ".bin"), "safetensors": (".safetensors",)}


def check_suffix(out: str, format: str) -> None:
    """Refuse ``model.safetensors`` with ``--format torch`` and the reverse: the file would not load as named
    (a Lightning ``.ckpt`` and a ``torch.save`` file are both ``torch.load``'s, so either takes the other's)."""
    name = out.rstrip("/").lower()
    for other, suffixes in SUFFIXES.items():
        if "safetensors" in (other, format) and other != format and name.endswith(suffixes):
            raise ConfigError(
                f"{out} names a {other} file, but --format {format} was asked for: give --format {other}, or a "
                f"name ending in {' or '.join(SUFFIXES[format])}"
                + (" (or a directory's)" if format == "safetensors" else "")
            )
