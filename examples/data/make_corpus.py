"""Rebuild corpus.txt: the public-domain passages, then text generated from them by a word Markov chain.

    python examples/data/make_corpus.py        # deterministic: the same corpus.txt every time

The generated part reuses only word sequences of the passages (an order-2 chain), so it reads like
English of the passages' period without being any existing text. See README.md.
"""

import random
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
TARGET_BYTES = 320_000
SENTENCE_END = (".", "!", "?")
ABBREVIATIONS = {"Mr.", "Mrs.", "Dr.", "St."}


def _prose_words(text):
    # Skip headings ("PSALM 23", "SONNETS (William Shakespeare, 1609)", "Chapter 1").
    lines = [
        line
        for line in text.splitlines()
        if line.strip() and not line.split("(")[0].isupper() and not line.startswith("Chapter ")
    ]
    return " ".join(lines).split()


def _chain(words):
    chain = defaultdict(list)
    for a, b, c in zip(words, words[1:], words[2:], strict=False):
        chain[(a, b)].append(c)
    return chain


def _sentence(chain, starts, rng):
    a, b = rng.choice(starts)
    words = [a, b]
    while len(words) < 60:
        followers = chain.get((a, b))
        if not followers:
            break
        a, b = b, rng.choice(followers)
        words.append(b)
        if b.endswith(SENTENCE_END) and b not in ABBREVIATIONS and len(words) >= 6:
            break
    text = " ".join(words)
    return text if text.endswith(SENTENCE_END) else text.rstrip(",;:") + "."


def main():
    passages = (HERE / "passages.txt").read_text(encoding="utf-8")
    words = _prose_words(passages)
    chain = _chain(words)
    starts = [
        (b, c)
        for a, b, c in zip(words, words[1:], words[2:], strict=False)
        if a.endswith(SENTENCE_END) and a not in ABBREVIATIONS and b[:1].isupper()
    ]
    rng = random.Random(0)
    parts = [passages.rstrip() + "\n"]
    size = len(parts[0].encode())
    chapter = 0
    while size < TARGET_BYTES:
        chapter += 1
        lines = [f"\nCHAPTER {chapter}\n"]
        for _ in range(rng.randint(4, 9)):
            lines.append(" ".join(_sentence(chain, starts, rng) for _ in range(rng.randint(3, 7))) + "\n")
        block = "\n".join(lines)
        parts.append(block)
        size += len(block.encode())
    (HERE / "corpus.txt").write_text("".join(parts), encoding="utf-8")
    print(f"wrote {HERE / 'corpus.txt'}: {size:,} bytes, {chapter} generated chapters")


if __name__ == "__main__":
    main()
