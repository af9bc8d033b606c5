"""Blocked terms: prompts naming a term the operator refuses are turned away before any model work.

Matching is on whole words after one normalisation of both the terms and the prompt (`fold`): NFKC (full-width
letters, ligatures, mathematical alphabets become plain ones), casefold, invisible format characters removed
(zero-width space/joiners, soft hyphen, bidi marks: "forbid\u200bden" reads as one word), accents dropped
("forbíddén"), and a short table of Cyrillic and Greek letters that look like Latin ones ("f\u043erbidden" with a
Cyrillic o). A term matches where it is not part of a longer word: "Forbiddenword," is caught, "forbiddenwordy"
is not. A term of several words matches them separated by any run of spaces or punctuation. This stops
casual and copy-paste evasion, not a determined adversary (letters spaced out, misspellings): the safety
checker on the image is the second line.

Terms come from `blocked_terms` and `blocked_terms_file` (one term a line, `#` comments); the file is read
again when it changes, so terms can be added without a restart. Torch-free: every entry calls it.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

from neuron_app.errors import ContentRefused

#: Letters of other scripts drawn like Latin ones (Unicode confusables, the common lowercase subset).
LOOKALIKES = str.maketrans(
    {
        # Cyrillic
        "а": "a", "в": "b", "е": "e", "ё": "e", "һ": "h", "і": "i", "ї": "i", "ј": "j", "к": "k", "м": "m",
        "н": "h", "о": "o", "р": "p", "с": "c", "т": "t", "у": "y", "х": "x", "ѕ": "s", "ԁ": "d", "ԛ": "q",
        "ԝ": "w", "ɡ": "g",
        # Greek
        "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t",
        "υ": "u", "χ": "x", "ω": "w",
    }
)  # fmt: skip
#: A letter or digit (a word character that is not `_`): what a match must not touch on either side.
_WORD = r"[^\W_]"


def fold(text: str) -> str:
    """The comparable form of a prompt or a term (see the module docstring); same for both sides."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(ch for ch in unicodedata.normalize("NFD", text) if unicodedata.category(ch) not in ("Cf", "Mn"))
    return unicodedata.normalize("NFC", text).translate(LOOKALIKES)


def _pattern(terms: Iterable[str]) -> re.Pattern[str] | None:
    words = sorted({tuple(re.findall(rf"{_WORD}+", fold(term))) for term in terms} - {()}, key=len, reverse=True)
    if not words:
        return None
    alternatives = "|".join(r"[\W_]+".join(map(re.escape, w)) for w in words)
    return re.compile(rf"(?<!{_WORD})(?:{alternatives})(?!{_WORD})")


@functools.lru_cache(maxsize=8)
def _compiled(terms: tuple[str, ...], file: str | None, stamp: tuple[int, int] | None) -> re.Pattern[str] | None:
    """One compiled pattern per set of terms (and version of the file): validation stays a single regex search."""
    return _pattern([*terms, *(read_terms_file(Path(file)) if file else ())])


def read_terms_file(path: Path) -> list[str]:
    """One term a line; blank lines and lines starting with `#` are skipped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _stamp(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size)


def find_blocked(prompt: str, terms: Sequence[str], file: Path | None = None) -> str | None:
    """The prompt's words that match a blocked term, as folded, or None."""
    if not terms and file is None:
        return None
    stamp = _stamp(file)
    pattern = _compiled(tuple(terms), str(file) if file is not None and stamp is not None else None, stamp)
    match = pattern.search(fold(prompt)) if pattern is not None else None
    return match.group(0) if match else None


def check_blocked(prompt: str, terms: Sequence[str], file: Path | None = None) -> None:
    """Raise `ContentRefused` (param prompt, code content_policy_violation) when the prompt names a blocked term."""
    found = find_blocked(prompt, terms, file)
    if found is not None:
        raise ContentRefused(
            f"prompt refused: it contains {found!r}, a term this server does not allow; rephrase it",
            param="prompt",
        )
