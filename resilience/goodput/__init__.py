"""Goodput: how much of a run's wall time trained the model, and where the rest went.

Framework-free; the Lightning and Accelerate adapters call these. matplotlib is imported only when the
report draws its picture.
"""

from resilience.goodput.accounting import GoodputConfig
from resilience.goodput.data import DataWaitMonitor, DataWindow, LoaderInfo, TimedIterator, describe_loader
from resilience.goodput.interval import AdaptiveInterval, IntervalConfig, IntervalPlan, young_daly_interval
from resilience.goodput.ledger import GoodputLedger
from resilience.goodput.summary import GoodputSummary, summarize
from resilience.goodput.telemetry import CheckpointTelemetry

__all__ = [
    "AdaptiveInterval",
    "CheckpointTelemetry",
    "DataWaitMonitor",
    "DataWindow",
    "GoodputConfig",
    "GoodputLedger",
    "GoodputSummary",
    "IntervalConfig",
    "IntervalPlan",
    "LoaderInfo",
    "TimedIterator",
    "describe_loader",
    "summarize",
    "young_daly_interval",
]
