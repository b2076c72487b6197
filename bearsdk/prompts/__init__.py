"""Prompts as the engines see them: a model's chat template and tokenizer, applied
as vLLM applies them, so that the router can hash a request's prompt into the
block chain an engine's prefix cache holds (issue 16).

Needs the ``tokenizers`` extra (``tokenizers`` and ``jinja2``):
:class:`~bearsdk.prompts.tokenizer.ChatTokenizer` loads a model directory's
``tokenizer.json`` and chat template; :mod:`~bearsdk.prompts.template` renders
the template as transformers does for vLLM.
"""
