"""vLLM's KV cache events: the wire format and a per-instance prefix index fed from them.

Needs the ``kvevents`` extra (msgspec; pyzmq for the transport). Issue 16's
prefix-aware routing builds on it: :mod:`~bearsdk.kvevents.wire` decodes what
``vllm serve --kv-events-config`` publishes, :class:`~bearsdk.kvevents.index.PrefixIndex`
keeps which prompt blocks an instance holds, matched by token ids.
"""
