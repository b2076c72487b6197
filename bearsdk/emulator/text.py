"""Text for the emulated engine: a stand-in tokenizer, output lengths, and filler output.

No model weights and no real tokenizer are available, so the emulator
approximates them deterministically:

* :class:`Tokenizer` splits text into word-like pieces (a leading space belongs to
  the word, as in BPE vocabularies; words longer than 7 letters take several
  tokens), which gives about 4.3 characters and 1.35 tokens per word on
  AlpacaEval's instructions, close to real BPE vocabularies. Chat
  messages are rendered with a ChatML template whose markers are one special
  token each, with Qwen's ids (``<|im_end|>`` is also the end-of-sequence token,
  as for a ChatML instruct model).
* :class:`OutputLengthModel` draws each request's true output length from a
  log-normal regression on the prompt length whose parameters depend on the task
  (``classify_prompt``: code, summarize, rewrite, short answer, list, creative,
  question; raw code or chat-like completions fall back to the Azure traces) and
  on the model; the draw is seeded by the prompt itself, so one prompt always
  gets the same length on one model. Parameters come from ``_derived.py``.
* :func:`filler_tokens` produces plausible English-looking output tokens, also
  seeded by the prompt. They are the tokenizer's own pieces, so an output sent
  back as text (the next turn of a conversation) encodes to the ids it was
  generated as, which is what lets that turn hit the prefix cache.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

__all__ = [
    "CODE_CATEGORY",
    "CONVERSATION_CATEGORY",
    "EOS_ID",
    "INSTRUCTION_CATEGORIES",
    "ChatMessageError",
    "CountingTokenizer",
    "OutputLengthModel",
    "Tokenizer",
    "classify_instruction",
    "classify_prompt",
    "filler_tokens",
    "prompt_seed",
]

# Keywords per task category, in priority order (the first category found wins).
_CATEGORY_KEYWORDS: Final = (
    (
        "code",
        "code function python javascript typescript java c++ sql program script regex html css "
        "bash implement algorithm compile debug",
    ),
    ("summarize", "summarize summarise summary tl;dr tldr shorten condense"),
    ("rewrite", "rewrite rephrase paraphrase proofread translate grammar edit"),
    (
        "short",
        "classify categorize categorise extract|true or false|yes or no|one word|single word"
        "|answer with|how many|which one",
    ),
    ("list", "list ideas suggest examples tips brainstorm recommend|ways to"),
    (
        "creative",
        "story poem song lyrics essay letter haiku joke limerick compose speech|script for",
    ),
)
_WORD: Final = re.compile(r"[a-z]+(?:\+\+|;dr)?")
_CATEGORIES: Final = tuple(
    (
        name,
        frozenset(spec.split("|")[0].split()),
        tuple(p for p in spec.split("|")[1:]),
    )
    for name, spec in _CATEGORY_KEYWORDS
)
INSTRUCTION_CATEGORIES: Final = (*(name for name, _ in _CATEGORY_KEYWORDS), "qa")
"""Task categories of instructions (AlpacaEval-fitted); ``qa`` is the default."""
CODE_CATEGORY: Final = "azure-code"
"""Raw completion prompts that look like source code (Azure code trace fit)."""
CONVERSATION_CATEGORY: Final = "azure-conv"
"""Raw completion prompts without a recognisable instruction (Azure conversation fit)."""

_CODE_HINT: Final = re.compile(r"(\bdef |\bimport |#include|\bclass |\breturn\b|[{};]\s*$)", re.M)
_CLASSIFY_CHARS: Final = 2000


def classify_instruction(text: str) -> str:
    """Task category of an instruction: the first category whose keywords it contains."""
    low = text[-_CLASSIFY_CHARS:].lower()
    words = set(_WORD.findall(low))
    for name, keys, phrases in _CATEGORIES:
        if not keys.isdisjoint(words) or any(_has_phrase(low, p) for p in phrases):
            return name
    return "qa"


def _has_phrase(low: str, phrase: str) -> bool:
    i = low.find(phrase)
    while i >= 0:
        j = i + len(phrase)
        if (i == 0 or not low[i - 1].isalnum()) and (j == len(low) or not low[j].isalnum()):
            return True
        i = low.find(phrase, i + 1)
    return False


def classify_prompt(text: str, *, chat: bool) -> str:
    """Task category of a prompt.

    Args:
        text: The instruction (chat: the last user message) or raw completion prompt.
        chat: Whether it came from a chat request (always an instruction).

    Returns:
        One of :data:`INSTRUCTION_CATEGORIES`, or for a raw completion prompt with
        no instruction keyword :data:`CODE_CATEGORY` / :data:`CONVERSATION_CATEGORY`.
    """
    cat = classify_instruction(text)
    if chat or cat != "qa":
        return cat
    tail = text[-_CLASSIFY_CHARS:]
    if len(_CODE_HINT.findall(tail)) >= 3:
        return CODE_CATEGORY
    return CONVERSATION_CATEGORY


def prompt_seed(*parts: str | bytes | Sequence[int]) -> int:
    """A 64-bit seed from the prompt (and the model name): same prompt, same draws."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, str):
            h.update(p.encode("utf-8", "surrogatepass"))
        elif isinstance(p, bytes):
            h.update(p)
        else:
            h.update(b",".join(str(int(t)).encode() for t in p))
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little")


# -- tokenizer ------------------------------------------------------------------

# One match per token: a word piece of up to 7 letters (with its leading space), up
# to 3 digits, a run of up to 4 other symbols, or up to 4 whitespace characters.
_TOKEN: Final = re.compile(r" ?[A-Za-z]{1,7}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,4}|\s{1,4}")
_SPECIAL_BASE: Final = 151643  # Qwen's special tokens start here
_MARKER: Final = re.compile(r"(<\|[a-z_]+\|>)")
# Qwen2/3's special tokens, in id order from _SPECIAL_BASE; other markers get an
# id after them (hashed, so that one name always gets one id).
_SPECIALS: Final = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
_SPECIAL_IDS: Final = {m: _SPECIAL_BASE + i for i, m in enumerate(_SPECIALS)}
_EXTRA_SPECIALS: Final = 256
EOS_ID: Final = _SPECIAL_IDS["<|im_end|>"]


class ChatMessageError(ValueError):
    """A chat message is malformed.

    Attributes:
        field: Dotted path of the offending field (``messages.2.content``).
        value: The rejected value.
    """

    def __init__(self, field: str, message: str, value: object = None) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field} {message}")


@attrs.frozen
class _Pieces:
    ids: list[str]


@attrs.frozen
class CountingTokenizer:
    """A :class:`Tokenizer` in ``tokenizers``' shape, ``encode(text).ids``, for the
    predictors' token counter (a deployment loads each model's ``tokenizer.json``).

    Only the count matters there, so ``ids`` are the token strings: no ids hashed.
    """

    tokenizer: Tokenizer

    def encode(self, sequence: str, /, *args: object, **kwargs: object) -> _Pieces:
        """Tokens of ``sequence`` (``.ids``: one entry per token)."""
        return _Pieces(self.tokenizer.pieces(sequence))


@attrs.frozen
class Tokenizer:
    """Deterministic stand-in tokenizer (about 4.3 characters per token on English).

    Attributes:
        vocab_size: Token ids are in ``[0, vocab_size)``.
    """

    vocab_size: int = 151936

    @property
    def eos(self) -> int:
        """The end-of-sequence id: ``<|im_end|>``, as a ChatML instruct model ends its turn."""
        return EOS_ID

    def special_id(self, marker: str) -> int:
        """The id of a ``<|...|>`` marker (Qwen's id where it has one)."""
        known = _SPECIAL_IDS.get(marker)
        if known is not None:
            return known
        crc = zlib.crc32(marker.encode("utf-8", "surrogatepass"))
        return _SPECIAL_BASE + len(_SPECIALS) + crc % _EXTRA_SPECIALS

    def pieces(self, text: str) -> list[str]:
        """Split ``text`` into token strings (concatenated they give ``text`` back)."""
        return _TOKEN.findall(text)

    def count(self, text: str) -> int:
        """Number of tokens in ``text``."""
        return len(_TOKEN.findall(text))

    def token_id(self, piece: str) -> int:
        """The id of one token string."""
        return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % (_SPECIAL_BASE - 1) + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.token_id(p) for p in self.pieces(text)]

    def counting(self) -> CountingTokenizer:
        """This tokenizer as the predictors' ``TokenizerLike`` (``encode(text).ids``)."""
        return CountingTokenizer(self)

    def render_chat(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        """Render OpenAI chat messages with the ChatML template.

        Args:
            messages: The request's ``messages``: a list of ``{"role", "content"}``
                objects; content is a string or a list of ``{"type": "text", "text"}``
                parts.
            add_generation_prompt: End with the assistant turn's header.

        Raises:
            ChatMessageError: A message is malformed (the field is named).
        """
        if not isinstance(messages, list):
            raise ChatMessageError("messages", "must be a list", messages)
        parts: list[str] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                raise ChatMessageError(f"messages.{i}", "must be an object", msg)
            role = msg.get("role")
            if not isinstance(role, str) or not role:
                raise ChatMessageError(f"messages.{i}.role", "must be a non-empty string", role)
            parts.append(f"<|im_start|>{role}\n{message_text(msg, i)}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def count_chat(self, rendered: str) -> int:
        """Tokens of a rendered chat prompt; each ``<|...|>`` marker is one token."""
        n = 0
        for i, seg in enumerate(_MARKER.split(rendered)):
            if i % 2:
                n += 1
            elif seg:
                n += self.count(seg)
        return n

    def chat_pieces(self, rendered: str) -> list[str]:
        """Token strings of a rendered chat prompt (a marker is one piece)."""
        out: list[str] = []
        for i, seg in enumerate(_MARKER.split(rendered)):
            if i % 2:
                out.append(seg)
            elif seg:
                out.extend(_TOKEN.findall(seg))
        return out

    def encode_chat(self, rendered: str) -> list[int]:
        """Token ids of a rendered chat prompt, :meth:`count_chat` of them: a marker is
        its special id, the text between markers is :meth:`encode`'s."""
        ids: list[int] = []
        for i, seg in enumerate(_MARKER.split(rendered)):
            if i % 2:
                ids.append(self.special_id(seg))
            elif seg:
                ids.extend(self.encode(seg))
        return ids

    def output_ids(self, texts: Sequence[str]) -> list[int]:
        """Ids of generated tokens given by their text (``""``: end of sequence)."""
        tid, eos = self.token_id, self.eos
        return [tid(t) if t else eos for t in texts]


def message_text(msg: Mapping[str, Any], index: int) -> str:
    """The text of one chat message's ``content`` (string, or text parts one per line)."""
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatMessageError(f"messages.{index}.content.{j}", "must be a text part", part)
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatMessageError(f"messages.{index}.content.{j}.text", "must be a string")
            texts.append(text)
        # One part per line, as vLLM joins them for string-content templates.
        return "\n".join(texts)
    raise ChatMessageError(f"messages.{index}.content", "must be a string or a list", content)


# -- output lengths -------------------------------------------------------------


@attrs.frozen
class OutputLengthModel:
    """Per-model, task-conditioned distribution of a request's true output length.

    ``log(tokens) = a[cat] + b[cat] * log(prompt_tokens) + offset + sd[cat] * z``
    with ``z`` standard normal, drawn from the prompt's seed.

    Attributes:
        categories: ``category -> (a, b, sd)``.
        offset: The model's verbosity offset (log tokens).
        max_len: Upper clamp of a natural length.
    """

    categories: Mapping[str, tuple[float, float, float]]
    offset: float = 0.0
    max_len: int = 16384

    @classmethod
    def from_table(cls, lengths: Mapping[str, Any], profile: str) -> OutputLengthModel:
        """Build the model of ``profile`` from the shipped ``LENGTHS`` table."""
        cats = {
            k: (float(v[0]), float(v[1]), float(v[2])) for k, v in lengths["categories"].items()
        }
        return cls(cats, float(lengths["model_offset"].get(profile, 0.0)))

    def median(self, category: str, prompt_tokens: int) -> float:
        """Median natural length (tokens) for a prompt of this category and length."""
        a, b, _ = self.categories[category]
        return math.exp(a + b * math.log(max(prompt_tokens, 1)) + self.offset)

    def sample(self, category: str, prompt_tokens: int, seed: int) -> int:
        """The natural (uncapped) output length of a prompt, deterministic in ``seed``."""
        if category not in self.categories:
            known = ", ".join(sorted(self.categories))
            raise ValueError(f"category must be one of {known} (got {category!r})")
        a, b, sd = self.categories[category]
        z = random.Random(seed).gauss(0.0, 1.0)
        mu = a + b * math.log(max(prompt_tokens, 1)) + self.offset
        return max(1, min(self.max_len, round(math.exp(mu + sd * z))))


# -- filler output ----------------------------------------------------------------

_WORDS: Final = tuple(
    """
the of and to in is that for it as with was on be by this are or at from an
which have not but can one all their more has will also been would there its
other than these time into some when may first two only new about used most
such system data model between each over well many where through both could
should very however example number process because approach result results
value different given first important case same large small following user
information important method based use point level while different number
work part make way these might each since order simple common problem answer
question step steps code function output input request server token tokens
batch memory cache latency throughput time first second third finally note
we you they it this that can help using possible good better best clear
specific general several certain likely often usually typically together
""".split()  # noqa: SIM905 (a list literal of 150 words is unreadable)
)
_PUNCT: Final = (",", ".", ".", ":", ";")


def filler_tokens(n: int, seed: int) -> list[str]:
    """``n`` plausible English-looking output token strings, deterministic in ``seed``.

    Each string is one :class:`Tokenizer` piece (a long word takes several), so the
    text they make encodes back to them.
    """
    if n <= 0:
        return []
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=n)
    marks = rng.random
    out: list[str] = []
    sentence = 0
    for w in words:
        if len(out) >= n:
            break
        r = marks()
        if sentence > 6 and r < 0.12:
            out.append(_PUNCT[int(r * 40) % len(_PUNCT)])
            sentence = 0
            continue
        word = (" " + w.capitalize() if out else w.capitalize()) if sentence == 0 else " " + w
        out.extend(_TOKEN.findall(word))
        sentence += 1
    return out[:n]
