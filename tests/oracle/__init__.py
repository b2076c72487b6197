"""Differential testing of the replay against vLLM's real V1 scheduler."""
