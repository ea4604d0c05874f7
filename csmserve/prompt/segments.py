"""Text segmentation for long-form speech: sentences, and clauses when a sentence is long.

`split_sentences(text)` and `SentenceSplitter` (text streamed in, piece by piece) are the same
code: `split_sentences(t) == splitter.feed(t) + splitter.flush()` for any way of cutting `t` into
pieces, so streamed text gives exactly the segments (hence the same speech) as the whole text.

Rules:
- A sentence ends at `.`, `!`, `?`, `…` (runs such as `?!` or `...` included) with any closing
  quotes/brackets after them, followed by whitespace and then a character that does not start
  with a lowercase letter; or at a blank line (paragraph break); or at the end of the text.
- A `.` does not end a sentence right after (no whitespace between) a known abbreviation (Mr., Dr., e.g., U.S.,
  etc.) or a single letter (initials: J. R. R. Tolkien), or when no whitespace follows (3.14, 1,000.5, a.m.).
- A long sentence (> max_words words or > max_chars characters) is cut into clauses, left to right:
  after a word ending in `,` `;` `:` or a dash once the piece has >= max_words // 2 words (or
  >= max_chars // 2 characters); and at a word boundary when the piece would pass max_words /
  max_chars (text without any punctuation is cut this way).
Whitespace inside a segment is collapsed to single spaces.
"""
from __future__ import annotations

import re

__all__ = ["SentenceSplitter", "split_sentences", "segment_spans", "ABBREVIATIONS"]

ABBREVIATIONS = frozenset("""
mr mrs ms mx dr prof sr jr st mt ft vs etc eg ie cf al approx dept govt inc ltd corp
jan feb apr jun jul aug sep sept oct nov dec nos vol vols pp ca lt sgt capt cmdr rev hon pres gov sen rep
""".split())  # words that also end sentences (no, us, am, sun...) are left out; dotted forms (U.S., a.m.) match by shape

_TERM = re.compile(r"(?:[.!?\u2026]+)[\"'\u201d\u2019\u00bb)\]}]*")
_PARA = re.compile(r"\n[ \t\r]*\n\s*")  # \r: a Windows client's blank line (\r\n\r\n)
_CLOSE = "\"'\u201d\u2019\u00bb)]}"
_CLAUSE_END = (",", ";", ":", "\u2014", "\u2013", "--", "-")


def _is_abbreviation(before: str) -> bool:
    """`before`: the text of the sentence up to (not including) a terminating '.'."""
    # \Z, not $: $ also matches before a final newline, which made "B\n." B's initial while "B" was in the buffer
    # and a sentence end once streaming had given "B" out in a clause
    m = re.search(r"(\S+)\Z", before)
    word = m.group(1).lstrip("\"'\u201c\u2018(\u00ab[{") if m else ""
    if not word:
        return False
    if len(word) == 1 and word.isalpha():  # an initial
        return True
    key = word.replace(".", "").lower()
    return key in ABBREVIATIONS or (("." in word) and all(len(p) <= 2 for p in word.split(".")) and word[0].isalpha())


class SentenceSplitter:
    """Feed text pieces as they arrive; get back the segments that are complete (final)."""

    def __init__(self, max_words: int = 25, max_chars: int = 250) -> None:
        if max_words < 2 or max_chars < 10:
            raise ValueError("max_words must be >= 2 and max_chars >= 10")
        self.max_words, self.max_chars = max_words, max_chars
        self._buf = ""  # text not yet emitted (the unfinished sentence and what follows it)
        self._long = False  # the unfinished sentence is already known to be long

    def feed(self, piece: str) -> list[str]:
        self._buf += piece
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """End of input: everything left, segmented."""
        out = self._drain(final=True)
        self._buf, self._long = "", False
        return out

    # ---- internals
    def _drain(self, final: bool) -> list[str]:
        out: list[str] = []
        while True:
            # after clauses given out, a paragraph break ends their sentence even with only whitespace before it here
            # (as in the whole text): "...box: \n\n" once left " \n\n", and the next sentence was cut as if long
            end = self._sentence_end(self._buf, final, started=self._long)
            if end is None:
                break
            sentence, self._buf = self._buf[:end], self._buf[end:]
            out += self._clauses(sentence.split(), complete=True)
            self._long = False
        if final:
            return out
        # an unfinished sentence already past the limits: its first clauses are final
        words = self._buf.split()
        complete_words = len(words) if self._buf[-1:].isspace() else max(0, len(words) - 1)  # whitespace after it
        self._long = self._long or self._too_long(words[:complete_words])
        if self._long and complete_words:
            pieces = self._clauses(words[:complete_words], complete=False)
            if pieces:  # the buffer from after their words
                out += pieces
                # the whitespace after their last word stays (a paragraph break there ends the sentence)
                m = re.match(r"\s*(?:\S+\s+){%d}\S+" % (sum(len(p.split()) for p in pieces) - 1), self._buf)
                self._buf = self._buf[m.end():] if m else ""
        return out

    def _too_long(self, words: list[str]) -> bool:
        return len(words) > self.max_words or len(" ".join(words)) > self.max_chars

    def _clauses(self, words: list[str], complete: bool) -> list[str]:
        """Cut a sentence's words into pieces; complete=False keeps back the last (unfinished) piece."""
        if not words:
            return []
        if complete and not self._long and not self._too_long(words):
            return [" ".join(words)]
        pieces, cur, chars = [], [], 0
        half_w, half_c = max(1, self.max_words // 2), self.max_chars // 2
        for w in words:
            if cur and (len(cur) + 1 > self.max_words or chars + 1 + len(w) > self.max_chars):
                pieces.append(" ".join(cur))  # hard cut at a word boundary
                cur, chars = [], 0
            chars += len(w) + (1 if cur else 0)
            cur.append(w)
            if w.rstrip(_CLOSE).endswith(_CLAUSE_END) and (len(cur) >= half_w or chars >= half_c):
                pieces.append(" ".join(cur))
                cur, chars = [], 0
        if cur and complete:
            pieces.append(" ".join(cur))
        return pieces

    def _sentence_end(self, buf: str, final: bool, started: bool = False) -> int | None:
        """End offset (exclusive) of the first complete sentence in buf, or None. started: buf begins inside a
        sentence whose first clauses were given out already (a paragraph break before any text here ends it)."""
        if not buf.strip():
            return None
        pos = 0
        while True:
            m_term = _TERM.search(buf, pos)
            m_para = _PARA.search(buf, pos)
            if m_para is not None and (m_term is None or m_para.start() < m_term.start()):
                if started or buf[:m_para.start()].strip():  # a break after some text, decided once text follows
                    return m_para.start() if m_para.end() < len(buf) or final else None
                pos = m_para.end()
                continue
            if m_term is None or m_term.end() == len(buf):
                return len(buf) if final else None
            end = m_term.end()
            rest = buf[end:]
            ws = len(rest) - len(rest.lstrip())
            if ws == len(rest):  # only whitespace follows: decided by what comes next
                return end if final else None
            # not an end: no whitespace after it (3.14, e.g.x, "a.m." mid-token), a lowercase word next, or an
            # abbreviation's "."
            if ws and not rest[ws].islower() and not (
                    m_term.group(0).rstrip(_CLOSE) == "." and _is_abbreviation(buf[:m_term.start()])):
                return end
            pos = end


def split_sentences(text: str, max_words: int = 25, max_chars: int = 250) -> list[str]:
    """Sentences of `text` (clauses for long ones), whitespace collapsed; [] for blank text."""
    s = SentenceSplitter(max_words, max_chars)
    return s.feed(text) + s.flush()


def segment_spans(text: str, segments: list[str], start: int = 0) -> list[tuple[int, int]]:
    """Each segment's [start, end) character offsets in `text` (segments are its next words, in order,
    whitespace collapsed: what split_sentences / SentenceSplitter give)."""
    spans, cursor = [], start
    for seg in segments:
        begin = end = cursor
        for i, _ in enumerate(seg.split()):
            m = _WORD.match(text, cursor)
            if m is None:
                break
            if i == 0:
                begin = m.start(1)
            end = cursor = m.end(1)
        spans.append((begin, end))
    return spans


_WORD = re.compile(r"\s*(\S+)")
