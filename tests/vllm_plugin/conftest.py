"""The ``vllm`` marker: registered here, and deselected unless ``-m`` names it."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: drives vLLM's real scheduler in the vllm-oracle environment; "
        "run with -m vllm (not in the default run)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Deselected by default even before pyproject's addopts excludes the marker.
    if "vllm" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="needs vLLM: run with -m vllm")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
