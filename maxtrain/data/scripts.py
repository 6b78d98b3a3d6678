"""Which writing system a character belongs to, by Unicode block ranges (jax-free, no tables to
install): the scripts a tokenizer is judged on (`maxtrain tokenizer stats`) and the ones an
extension may add tokens for (`maxtrain tokenizer extend`, see `anchored_prefix`)."""

from __future__ import annotations

import bisect
import re

# (first, last, script): non-overlapping, sorted. Ranges not listed are "Other"; digits,
# punctuation and symbols of ASCII and Latin-1 are "Common", and so are the dandas (U+0964-0965)
# that Bengali, Odia and the other Indic scripts write too.
RANGES = [
    (0x0041, 0x005A, "Latin"), (0x0061, 0x007A, "Latin"), (0x00C0, 0x024F, "Latin"),
    (0x0370, 0x03FF, "Greek"), (0x0400, 0x052F, "Cyrillic"), (0x0530, 0x058F, "Armenian"),
    (0x0590, 0x05FF, "Hebrew"), (0x0600, 0x06FF, "Arabic"), (0x0750, 0x077F, "Arabic"),
    (0x0900, 0x0963, "Devanagari"), (0x0964, 0x0965, "Common"), (0x0966, 0x097F, "Devanagari"), (0x0980, 0x09FF, "Bengali"), (0x0A00, 0x0A7F, "Gurmukhi"),
    (0x0A80, 0x0AFF, "Gujarati"), (0x0B00, 0x0B7F, "Odia"), (0x0B80, 0x0BFF, "Tamil"),
    (0x0C00, 0x0C7F, "Telugu"), (0x0C80, 0x0CFF, "Kannada"), (0x0D00, 0x0D7F, "Malayalam"),
    (0x0D80, 0x0DFF, "Sinhala"), (0x0E00, 0x0E7F, "Thai"), (0x0E80, 0x0EFF, "Lao"),
    (0x0F00, 0x0FFF, "Tibetan"), (0x1000, 0x109F, "Myanmar"), (0x10A0, 0x10FF, "Georgian"),
    (0x1100, 0x11FF, "Hangul"), (0x1200, 0x139F, "Ethiopic"), (0x1780, 0x17FF, "Khmer"),
    (0x1E00, 0x1EFF, "Latin"), (0x1F00, 0x1FFF, "Greek"), (0x3040, 0x309F, "Hiragana"),
    (0x30A0, 0x30FF, "Katakana"), (0x3400, 0x4DBF, "Han"), (0x4E00, 0x9FFF, "Han"),
    (0xAC00, 0xD7AF, "Hangul"),
]
_STARTS = [r[0] for r in RANGES]
SCRIPTS = sorted({r[2] for r in RANGES})
WORD = re.compile(r"\S+")


def script_of(ch: str) -> str:
    """The script of one character: a name of `SCRIPTS`, "Common" (ASCII and Latin-1 digits,
    punctuation, symbols) or "Other"."""
    cp = ord(ch)
    i = bisect.bisect_right(_STARTS, cp) - 1
    if i >= 0 and cp <= RANGES[i][1]:
        return RANGES[i][2]
    return "Common" if cp < 0x250 else "Other"


def word_script(word: str) -> str:
    """The script most of a word's letters are in ("Common" when it has none: numbers, punctuation)."""
    counts: dict[str, int] = {}
    for ch in word:
        s = script_of(ch)
        if s != "Common":
            counts[s] = counts.get(s, 0) + 1
    return max(sorted(counts), key=counts.get) if counts else "Common"


def script_shares(texts, min_share: float = 0.0) -> dict[str, float]:
    """Each script's share of the letters (not Common) in `texts`, largest first."""
    counts: dict[str, int] = {}
    for text in texts:
        for ch in text:
            s = script_of(ch)
            if s != "Common":
                counts[s] = counts.get(s, 0) + 1
    total = sum(counts.values()) or 1
    return {s: c / total for s, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c / total >= min_share}


def ranges_of(scripts) -> list[tuple[int, int]]:
    """The code point ranges of `scripts`."""
    unknown = set(scripts) - set(SCRIPTS)
    if unknown:
        raise ValueError(f"unknown script(s) {', '.join(sorted(unknown))}; known: {', '.join(SCRIPTS)}")
    return [(lo, hi) for lo, hi, s in RANGES if s in set(scripts)]


def anchored_prefix(data: bytes, ranges: list[tuple[int, int]]) -> bool:
    """Whether `data` holds the start of a UTF-8 character long enough that every character
    beginning with those bytes is in `ranges`: such bytes can only occur in text that has a
    character of those scripts (UTF-8 is self-synchronising: a lead byte always starts a character).
    For the Indic scripts that is the lead byte and the next one (a 64-code-point block)."""
    for i, b in enumerate(data):
        n = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 0
        if not n:
            continue
        for k in range(2, n + 1):
            if i + k > len(data) or not all(0x80 <= c < 0xC0 for c in data[i + 1:i + k]):
                break
            lo, hi = _prefix_range(data[i:i + k], n)
            if any(a <= lo and hi <= z for a, z in ranges):
                return True
    return False


def _prefix_range(prefix: bytes, n: int) -> tuple[int, int]:
    """The code points whose n-byte UTF-8 encodings start with `prefix`."""
    lead_bits = {2: 0x1F, 3: 0x0F, 4: 0x07}[n]
    cp = prefix[0] & lead_bits
    for c in prefix[1:]:
        cp = (cp << 6) | (c & 0x3F)
    rest = 6 * (n - len(prefix))
    return cp << rest, (cp << rest) | ((1 << rest) - 1)
