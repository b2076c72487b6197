"""Feature layout and keyword lexicon shared by both feature extractors.

``cext/_features_c.pyx`` and :mod:`bearsdk.predictors._features_py` both read
this module, so the feature layout and the keywords cannot drift apart. Changing
anything here changes the features a trained predictor expects: bump
:data:`FEATURE_VERSION` so that old predictor files are refused on load instead
of silently mispredicting.

Tokens are what the built-in pre-tokenizer yields: maximal runs of alphanumeric
characters (``str.isalnum``), ASCII-lowercased, and every other non-space
character on its own (``_`` included). Keywords match whole tokens.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "FEATURE_VERSION",
    "FLAG_BREVITY",
    "FLAG_DETAIL",
    "HASH_SIGN_SHIFT",
    "NUMBER_CAP",
    "PCA_SCALE_BITS",
    "SCALAR_FEATURES",
    "TASK_FEATURES",
    "UNIT_ITEMS",
    "UNIT_PARAGRAPHS",
    "UNIT_SENTENCES",
    "UNIT_WORDS",
    "lexicon_entries",
    "prompt_feature_names",
]

FEATURE_VERSION: Final = 1
"""Version of the tokenizer, hash, lexicon and layout below."""

PCA_SCALE_BITS: Final = 24
"""PCA components are stored as integers scaled by ``2**PCA_SCALE_BITS``: the
projection is then an exact integer sum, identical in both implementations."""

HASH_SIGN_SHIFT: Final = 63
NUMBER_CAP: Final = 1_000_000
"""Numbers in prompts are capped here (``"under 10000000 words"`` is no constraint)."""

# Scalar features after the PCA components, in this order.
SCALAR_FEATURES: Final = (
    "n_tokens",  # pre-tokenizer tokens (model-independent)
    "n_chars",
    "n_sentences",
    "avg_chars_per_token",
    "n_lines",
    "frac_punct",
    "frac_numeric",
    "n_questions",
    "limit_words",  # "under 100 words", "a 50-word ...", "in 200 characters"
    "limit_sentences",  # "in 3 sentences", "one sentence"
    "limit_paragraphs",
    "limit_items",  # "5 tips", "10 bullet points", "4 lines"
    "limit_value",  # the number of the first constraint, 0 if none
    "brevity",  # "brief", "concise", "short", ...
    "detail",  # "detailed", "thorough", "comprehensive", ...
)

UNIT_WORDS: Final = 1
UNIT_SENTENCES: Final = 2
UNIT_PARAGRAPHS: Final = 3
UNIT_ITEMS: Final = 4

# Task-type indicators: 1.0 when any keyword of the task occurs in the prompt.
_TASKS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("task_list", ("list", "lists", "enumerate", "bullet", "bullets", "bulleted", "outline")),
    (
        "task_summarize",
        (
            "summarize",
            "summarise",
            "summary",
            "summaries",
            "summarizing",
            "summarization",
            "tldr",
            "condense",
            "recap",
            "abstract",
            "gist",
        ),
    ),
    (
        "task_explain",
        ("explain", "explanation", "describe", "description", "why", "clarify", "meaning"),
    ),
    (
        "task_code",
        (
            "code",
            "function",
            "python",
            "javascript",
            "java",
            "sql",
            "program",
            "script",
            "implement",
            "algorithm",
            "regex",
            "html",
            "css",
            "bash",
            "compile",
            "debug",
            "bug",
            "api",
            "json",
        ),
    ),
    (
        "task_creative",
        (
            "story",
            "poem",
            "essay",
            "write",
            "letter",
            "email",
            "lyrics",
            "song",
            "haiku",
            "fiction",
            "narrative",
            "creative",
            "tweet",
            "blog",
            "wp",
        ),
    ),
    (
        "task_math",
        (
            "calculate",
            "compute",
            "solve",
            "equation",
            "math",
            "sum",
            "multiply",
            "divide",
            "integral",
            "probability",
            "percent",
            "percentage",
        ),
    ),
    (
        "task_translate",
        ("translate", "translation", "french", "spanish", "german", "chinese", "japanese"),
    ),
    (
        "task_classify",
        (
            "classify",
            "categorize",
            "categorise",
            "category",
            "sentiment",
            "label",
            "identify",
            "extract",
            "detect",
        ),
    ),
    (
        "task_rewrite",
        (
            "rewrite",
            "paraphrase",
            "rephrase",
            "edit",
            "proofread",
            "grammar",
            "correct",
            "improve",
            "simplify",
        ),
    ),
    (
        "task_compare",
        ("compare", "comparison", "difference", "differences", "versus", "vs", "contrast"),
    ),
    (
        "task_advice",
        ("suggest", "recommend", "recommendation", "ideas", "tips", "advice", "brainstorm"),
    ),
    ("task_question", ("who", "what", "when", "where", "which", "how", "question")),
)

TASK_FEATURES: Final = tuple(name for name, _ in _TASKS)

FLAG_BREVITY: Final = 1 << len(_TASKS)
FLAG_DETAIL: Final = 1 << (len(_TASKS) + 1)

_BREVITY: Final = ("brief", "briefly", "concise", "concisely", "short", "succinct", "succinctly")
_DETAIL: Final = (
    "detailed",
    "detail",
    "details",
    "thorough",
    "thoroughly",
    "comprehensive",
    "extensive",
    "elaborate",
    "depth",
    "lengthy",
)

_UNITS: Final[dict[int, tuple[str, ...]]] = {
    UNIT_WORDS: ("word", "words", "character", "characters", "char", "chars", "token", "tokens"),
    UNIT_SENTENCES: ("sentence", "sentences"),
    UNIT_PARAGRAPHS: ("paragraph", "paragraphs"),
    UNIT_ITEMS: (
        "item",
        "items",
        "point",
        "points",
        "bullet",
        "bullets",
        "line",
        "lines",
        "step",
        "steps",
        "tip",
        "tips",
        "way",
        "ways",
        "example",
        "examples",
        "idea",
        "ideas",
        "reason",
        "reasons",
        "question",
        "questions",
    ),
}

_NUMBER_WORDS: Final = {
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "fifteen": 15,
    "twenty": 20,
    "thirty": 30,
    "fifty": 50,
    "hundred": 100,
}


def prompt_feature_names(n_components: int) -> tuple[str, ...]:
    """Return the names of the prompt features, in order, for ``n_components`` PCA components."""
    return (
        *(f"pca_{i}" for i in range(n_components)),
        *SCALAR_FEATURES,
        *TASK_FEATURES,
    )


def lexicon_entries() -> list[tuple[str, int, int, int]]:
    """Return ``(token, flags, unit, number)`` for every keyword, sorted by token.

    ``flags`` has bit ``i`` set for ``TASK_FEATURES[i]``, plus :data:`FLAG_BREVITY`
    and :data:`FLAG_DETAIL`; ``unit`` is a ``UNIT_*`` constant or 0; ``number`` is
    the value of a number word or 0.
    """
    table: dict[str, list[int]] = {}

    def entry(token: str) -> list[int]:
        return table.setdefault(token, [0, 0, 0])

    for bit, (_, words) in enumerate(_TASKS):
        for w in words:
            entry(w)[0] |= 1 << bit
    for w in _BREVITY:
        entry(w)[0] |= FLAG_BREVITY
    for w in _DETAIL:
        entry(w)[0] |= FLAG_DETAIL
    for unit, words in _UNITS.items():
        for w in words:
            entry(w)[1] = unit
    for w, value in _NUMBER_WORDS.items():
        entry(w)[2] = value
    return [(tok, f, u, n) for tok, (f, u, n) in sorted(table.items())]
