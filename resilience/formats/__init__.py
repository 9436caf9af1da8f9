"""File formats the engine writes from a committed step without the framework that defined them.

``lightning_ckpt`` is Lightning's checkpoint dict as plain data, ``torch_file`` a ``torch.save`` file written
one tensor at a time, ``safetensors_file`` Hugging Face's safetensors layout. None of them imports Lightning
or Accelerate: ``resilience export`` runs where only the engine is installed.
"""
