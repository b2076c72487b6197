"""Where the public data sets some commands read live, and what to say when they are missing.

bearsdk ships none of these data (some are CC BY-NC, all are read in place): a
command or example that needs one takes a data folder, resolved by
:func:`data_dir` in this order:

1. the ``--data-dir`` the user gave (``explicit``);
2. ``$BEARSDK_DATA``;
3. ``$BEARSDK_SHARED_DATA``, then ``$BEARSDK_SHARED/data`` (older names, still read);
4. ``shared/data`` next to a source checkout (``<checkout>/../shared/data``).

The first of 1-3 that is set is the only place looked at: pointing
``BEARSDK_DATA`` somewhere is never overridden by a copy found elsewhere. The
folder holds one sub-folder per data set (:data:`DATASETS`); when the one
needed is not there, :class:`DataNotFoundError` names it, where it was looked
for, and its public source.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import attrs

from bearsdk.errors import BearError

__all__ = ["DATASETS", "DataNotFoundError", "DataSet", "data_dir", "find_data_dir"]


@attrs.frozen
class DataSet:
    """One public data set bearsdk can read in place.

    Attributes:
        name: Its name in error messages and docs.
        folder: Its sub-folder of the data folder.
        title: What it is.
        source: Where to get it (public URL and path).
        licence: Its licence.
    """

    name: str
    folder: str
    title: str
    source: str
    licence: str


DATASETS: Final = {
    d.name: d
    for d in (
        DataSet(
            "azure-llm-2023",
            "azure_llm_2023",
            "Azure LLM inference trace 2023 (Splitwise, ISCA'24)",
            "https://github.com/Azure/AzurePublicDataset "
            "(data/AzureLLMInferenceTrace_conv.csv, data/AzureLLMInferenceTrace_code.csv)",
            "CC BY 4.0",
        ),
        DataSet(
            "vidur-traces",
            "vidur_traces",
            "Vidur processed request traces (Azure 2023, ShareGPT and arXiv-summarization lengths)",
            "https://github.com/microsoft/vidur (data/processed_traces/; the ShareGPT "
            "file is in the vidur-0.0.14 sdist on PyPI)",
            "MIT",
        ),
        DataSet(
            "vidur-profiling",
            "vidur_profiling",
            "Vidur GPU profiling (median MLP/linear-op and collective times)",
            "https://github.com/microsoft/vidur (data/profiling/compute/, data/profiling/network/; "
            "median columns concatenated)",
            "MIT",
        ),
        DataSet(
            "mooncake",
            "mooncake",
            "Mooncake FAST'25 request traces",
            "https://github.com/kvcache-ai/Mooncake (FAST25-release/traces/)",
            "Apache-2.0",
        ),
        DataSet(
            "alpaca-eval",
            "alpaca_eval",
            "AlpacaEval per-prompt output lengths and judge preferences",
            "https://github.com/tatsu-lab/alpaca_eval (results/<model>/model_outputs.json, "
            "results/<model>/<annotator>/annotations.json; reshaped to tables by prompt)",
            "CC BY-NC 4.0, evaluation only",
        ),
    )
}
"""The data sets, by name."""

_ENV: Final = ("BEARSDK_DATA", "BEARSDK_SHARED_DATA")


class DataNotFoundError(BearError, FileNotFoundError):
    """A data set is not where bearsdk looked; the message says where to get it.

    Attributes:
        dataset: The missing data set.
        looked: The folders looked in, each with what pointed there.
    """

    def __init__(self, dataset: DataSet, looked: tuple[str, ...]) -> None:
        self.dataset = dataset
        self.looked = looked
        where = "; ".join(looked) if looked else "nowhere (no data folder given)"
        super().__init__(
            f"data set {dataset.name!r} ({dataset.title}) not found: looked for "
            f"{dataset.folder}/ in {where}; get it from {dataset.source} [{dataset.licence}] "
            f"and pass --data-dir or set BEARSDK_DATA to the folder holding {dataset.folder}/"
        )


def _candidates(explicit: str | Path | None) -> list[tuple[Path, str]]:
    if explicit is not None and str(explicit):
        return [(Path(explicit), "--data-dir")]
    for var in _ENV:
        v = os.environ.get(var)
        if v:
            return [(Path(v), f"${var}")]
    v = os.environ.get("BEARSDK_SHARED")
    if v:
        return [(Path(v) / "data", "$BEARSDK_SHARED/data")]
    # A source checkout: bearsdk/data.py -> <checkout>/bearsdk -> <checkout>/../shared/data.
    return [(Path(__file__).resolve().parents[2] / "shared" / "data", "the checkout's ../shared")]


def find_data_dir(explicit: str | Path | None = None) -> Path | None:
    """Return the data folder :func:`data_dir` would look in, or ``None`` when it does not exist."""
    ((path, _),) = _candidates(explicit)
    return path if path.is_dir() else None


def data_dir(explicit: str | Path | None, dataset: str) -> Path:
    """Return the data folder holding ``dataset`` (in its ``DATASETS[dataset].folder``).

    Args:
        explicit: The folder the user named (``--data-dir``), or ``None`` to use
            the environment (see the module docstring).
        dataset: A name of :data:`DATASETS`.

    Raises:
        DataNotFoundError: The folder or its ``dataset`` sub-folder does not exist.
        KeyError: ``dataset`` is not a known data set.
    """
    ds = DATASETS[dataset]
    looked = []
    for path, why in _candidates(explicit):
        if (path / ds.folder).is_dir():
            return path
        looked.append(f"{str(path)[:200]} ({why})")
    raise DataNotFoundError(ds, tuple(looked))
