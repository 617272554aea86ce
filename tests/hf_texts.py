"""Text for the hf task's tests: folders of random sentences over a few words."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "peers",
    "train",
    "one",
    "model",
]


def write_texts(folder: Path, files: int = 4, lines: int = 150, seed: int = 0) -> Path:
    """A folder of text files of random sentences (deterministic in `seed`)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        sentences = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines))
        (folder / f"part{i}.txt").write_text(".\n".join(sentences))
    return folder
