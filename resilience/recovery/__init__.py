"""Lost, hung or slow ranks: liveness, survivor saves, restart in place, and the ``resilience launch`` launcher."""
