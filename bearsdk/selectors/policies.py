"""The old home of BEAR, Lagrangian, LatencyAgnostic and PrefillTPS.

They live in :mod:`bearsdk.selectors.bear` ("policy" is no longer bearsdk's word
for a selector); import them from :mod:`bearsdk.selectors`. This module stays
for one release.
"""

from bearsdk.selectors.bear import BEAR, Lagrangian, LatencyAgnostic, PrefillTPS

__all__ = ["BEAR", "Lagrangian", "LatencyAgnostic", "PrefillTPS"]
