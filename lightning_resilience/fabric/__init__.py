"""Lightning Fabric adapter: ``fabric.save`` and ``fabric.load`` through the engine, a one-line resume, and
callbacks for the health guard and the goodput ledger (docs/FABRIC.md).

Importing this package registers the ``"resilient_ddp"`` strategy name with Fabric.
"""

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.fabric.loop import GoodputMonitor, HealthGuardCallback, resume
from lightning_resilience.fabric.strategy import ResilientDDPStrategy

__all__ = ["GoodputMonitor", "HealthGuardCallback", "ResilientCheckpointIO", "ResilientDDPStrategy", "resume"]
