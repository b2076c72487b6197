"""A decision's record of every candidate, each built the first time it is read.

A decision prices every instance, but on the request's own path only the
chosen candidate is read (to dispatch it, and to learn from its first
token). A :class:`~bearsdk.router.decision.Candidate` is a frozen value of 24
fields and costs about a microsecond and a half to build: on a pool of
hundreds, building them all would cost more than the choice itself. So
:class:`Candidates` keeps the priced rows and the selector's verdicts, and
builds a candidate when something reads it: ``explain()``, the metrics and
decision-log hooks, the gateway's decision history, a failover. Read, it is
the tuple it stands for: equal to it, hashing and printing as it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Final, final, overload

import attrs

from bearsdk.router.decision import Candidate
from bearsdk.router.pricing import UNPRICED, Row
from bearsdk.selectors import Selection

__all__ = ["Candidates", "candidate"]

# candidate() passes Candidate's fields by position (keywords cost twice as much
# for a frozen class of 24 fields): the order it assumes, checked once.
_CANDIDATE_FIELDS: Final = [
    "instance",
    "model",
    "accuracy",
    "cost",
    "utility",
    "ttft_s",
    "feasible",
    "score",
    "estimator",
    "snapshot_age_s",
    "queue",
    "prompt_tokens",
    "output_tokens",
    "speed_factor",
    "overhead_s",
    "ttft_lower_bound",
    "tpot_s",
    "resident_itl_s",
    "resident_itl_base_s",
    "resident_tpot_target_s",
    "cached_tokens",
    "cache_source",
    "arrivals_s",
    "margin",
]
assert [f.name for f in attrs.fields(Candidate)] == _CANDIDATE_FIELDS, "Candidate's fields moved"


def candidate(row: Row, feasible: bool | None, score: float) -> Candidate:
    """The record of one priced row, with the selector's verdict and score.

    An unpriced row has no estimate: ``ttft_s`` is ``nan`` and ``feasible``
    ``None`` (the selector saw ``inf``, never on time).
    """
    o, est, age, ptok, out_tok, speed, overhead, bound, cached, source, arr, margin = row
    skipped = est == UNPRICED
    return Candidate(
        o.instance,
        o.model,
        o.accuracy,
        o.cost,
        o.utility,
        math.nan if skipped else o.ttft_s,
        None if skipped else feasible,
        score,
        est,
        age,
        o.queue,
        ptok,
        out_tok,
        speed,
        overhead,
        bound,
        o.tpot_s,
        o.resident_itl_s,
        o.resident_itl_base_s,
        o.resident_tpot_target_s,
        cached,
        source,
        arr,
        margin,
    )


@final
class Candidates(Sequence[Candidate]):
    """Every candidate of a decision, in pool order, built on first read.

    Args:
        rows: The priced rows.
        sel: The selector's selection over them (its verdicts and scores).
    """

    __slots__ = ("_built", "_feasible", "_rows", "_scores")

    def __init__(self, rows: Sequence[Row], sel: Selection) -> None:
        self._rows = rows
        self._feasible = sel.feasible
        self._scores = sel.scores
        self._built: list[Candidate | None] = [None] * len(rows)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Candidate, ...]: ...

    def __getitem__(self, i: int | slice) -> Candidate | tuple[Candidate, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self._rows))))
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError(f"candidate index {i} out of range for {n} candidates")
        if i < 0:
            i += n
        got = self._built[i]
        if got is None:
            f = self._feasible
            got = candidate(self._rows[i], None if f is None else f[i], self._scores[i])
            self._built[i] = got
        return got

    def gauges(self) -> Iterator[tuple[str, str, float, float, float, float]]:
        """Each candidate's instance, estimator, snapshot age, speed factor,
        first-token overhead and margin, read from its row: what the metrics
        record of every candidate, without building the candidates."""
        for row in self._rows:
            yield row[0].instance, row[1], row[2], row[5], row[6], row[11]

    def __iter__(self) -> Iterator[Candidate]:
        for i in range(len(self._rows)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Candidates | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))
