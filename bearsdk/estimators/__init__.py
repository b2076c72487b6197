"""Latency estimators: BEA (replay), and the analytical and baseline ones."""

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot, TTFTEstimate
from bearsdk.estimators.length import LengthPredictor, MeanLengthPredictor, resolve_output_lengths

__all__ = [
    "BEAEstimator",
    "BatchTimeModel",
    "LengthPredictor",
    "MeanLengthPredictor",
    "PreparedSnapshot",
    "TTFTEstimate",
    "resolve_output_lengths",
]
