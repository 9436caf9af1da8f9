"""The training process's side of a save and a load: agree, flatten, stage into shared memory, hand off; read back."""
