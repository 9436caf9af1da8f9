"""The background half of a save: DCP files written and hashed, committed, uploaded, in a helper process or threads."""
