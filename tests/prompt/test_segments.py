"""Sentence and clause segmentation (csmserve/prompt/segments.py)."""
import random
import re

import pytest

from csmserve.prompt.segments import SentenceSplitter, split_sentences


@pytest.mark.parametrize("text, want", [
    ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
    ("Mr. Smith met Dr. Jones. They talked.", ["Mr. Smith met Dr. Jones.", "They talked."]),
    ("Use a tool, e.g. a hammer. Or i.e. this one.", ["Use a tool, e.g. a hammer.", "Or i.e. this one."]),
    ("The U.S. Army left at 5 p.m. today. Then rain.", ["The U.S. Army left at 5 p.m. today.", "Then rain."]),
    ("Pi is 3.14 and we sold 1,000 units. Good.", ["Pi is 3.14 and we sold 1,000 units.", "Good."]),
    ("Wait... what? Well... Then go.", ["Wait... what?", "Well...", "Then go."]),
    ('He said "Stop." Then he left (quietly.) Done?!', ['He said "Stop."', "Then he left (quietly.)", "Done?!"]),
    ("J. R. R. Tolkien wrote it. Yes.", ["J. R. R. Tolkien wrote it.", "Yes."]),
    ("Come with us. No. I am.", ["Come with us.", "No.", "I am."]),
    ("First paragraph\n\nsecond one  \n with   spaces", ["First paragraph", "second one with spaces"]),
    ("no final punctuation here", ["no final punctuation here"]),
    ("", []),
    ("  \n ", []),
])
def test_sentences(text, want):
    assert split_sentences(text) == want


def test_long_sentence_is_cut_into_clauses():
    words = [f"w{i}" for i in range(40)]
    words[14] += ","  # a clause end after the half-way point
    words[30] += ";"
    out = split_sentences(" ".join(words) + ".")
    assert out == [" ".join(words[:15]), " ".join(words[15:31]), " ".join(words[31:]) + "."]
    short = "a, b, c, d."  # commas in a short sentence do not cut it
    assert split_sentences(short) == [short]


def test_no_punctuation_at_all_cuts_at_word_boundaries():
    text = " ".join(f"word{i}" for i in range(60))
    out = split_sentences(text, max_words=25)
    assert [len(p.split()) for p in out] == [25, 25, 10]
    assert " ".join(out) == text
    long_chars = " ".join(["abcdefghij"] * 40)  # 440 characters, 40 words
    assert all(len(p) <= 100 for p in split_sentences(long_chars, max_words=100, max_chars=100))


def test_streamed_pieces_give_the_same_segments():
    text = ('Mr. Smith paid $3.14 for 1,000 apples. "Really?!" she asked... Then she left (quietly.) '
            + " ".join(f"filler{i}" for i in range(70)) + ". The U.S. Army, e.g. its band, played; "
            + ", ".join(f"clause{i} and more words here" for i in range(12)) + ". End\n\nNew paragraph")
    want = split_sentences(text)
    rng = random.Random(0)
    for trial in range(30):
        s, out, i = SentenceSplitter(), [], 0
        while i < len(text):
            n = rng.randint(1, 12) if trial else 1  # trial 0: one character at a time
            out += s.feed(text[i:i + n])
            i += n
        out += s.flush()
        assert out == want


def test_a_paragraph_break_after_a_long_sentence_s_clauses_ends_it_streamed_too():
    """A long sentence whose clauses went out while it streamed, then a blank line (an LLM's "...the box:\n\n"):
    the break ends it, as in the whole text, so the next short sentence is not cut into clauses."""
    text = ("Before you start, make sure that you have gathered every one of the tools and all of the materials, "
            "and then read the instructions printed on the inside of the lid of the box:\n\n"
            "First, open the big box and take out all of the parts, then lay them out on the table in front of you.")
    s, out = SentenceSplitter(), []
    for token in re.findall(r"\S+|\s+", text):  # an LLM's tokens: words and the whitespace between them
        out += s.feed(token)
    assert out + s.flush() == split_sentences(text)
    last = split_sentences(text)[-1]
    assert last.startswith("First, open the big box") and last.endswith("you.")


def test_streamed_first_sentence_is_emitted_before_the_end():
    s = SentenceSplitter()
    assert s.feed("Hello there. How") == ["Hello there."]
    assert s.feed(" are") == []
    assert s.feed(" you? ") == []  # decided by what follows
    assert s.feed("Fine") == ["How are you?"]
    assert s.flush() == ["Fine"]
    long = SentenceSplitter(max_words=6)  # a long sentence's first clauses go before its end
    assert long.feed("one two three four five six seven eight, nine ten") == ["one two three four five six"]
