"""File formats the engine writes from a committed step without the framework that defined them.

``lightning_ckpt`` is Lightning's checkpoint dict as plain data, ``torch_file`` a ``torch.save`` file written
one tensor at a time, ``safetensors_file`` Hugging Face's safetensors layout. None of them imports Lightning
or Accelerate: ``resilience export`` runs where only the engine is installed.
"""

from __future__ import annotations

import torch


def raw_bytes(value: torch.Tensor | torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU tensor in row-major order (or of a storage), without a copy when it is contiguous."""
    if isinstance(value, torch.UntypedStorage):
        value = torch.empty(0, dtype=torch.uint8).set_(value)
    flat = value.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")
