"""Tests of the vLLM snapshot publisher (``bearsdk.vllm``).

``test_publisher.py`` needs no vLLM and runs by default. ``test_oracle.py``
(marker ``vllm``) drives vLLM's real scheduler on a CPU in the vllm-oracle
environment and runs only when asked for::

    .venv/bin/python -m pytest -m vllm tests/vllm_plugin
"""
