"""Checkpoint tiers and what is in them: file names, manifests, discovery, owners, leases and retention."""
