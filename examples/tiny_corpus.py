"""A text corpus the repository generates itself: sentences from a small random grammar.

Deterministic for a seed, character-level, with enough structure (agreement, fixed phrases,
counting) that a small transformer's loss falls well below a unigram model's, in minutes."""
import random

SUBJECTS = [("the cat", "s"), ("the dog", "s"), ("a bird", "s"), ("my friend", "s"), ("the children", ""),
            ("we", ""), ("they", ""), ("the old man", "s"), ("two horses", ""), ("the teacher", "s")]
VERBS = ["like", "see", "chase", "find", "watch", "follow", "carry", "paint"]
OBJECTS = ["the red ball", "a small house", "the green tree", "an apple", "the river", "a blue kite",
           "the moon", "three stones"]
PLACES = ["in the park", "near the river", "at home", "on the hill", "by the sea", "under the bridge"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.7:
        subj, s = rng.choice(SUBJECTS)
        verb = rng.choice(VERBS) + s
        out = f"{subj} {verb} {rng.choice(OBJECTS)}"
        if rng.random() < 0.5:
            out += " " + rng.choice(PLACES)
        return out + "."
    start = rng.randrange(0, 6)
    return "count: " + " ".join(NUMBERS[start:start + 4]) + "."


def make_text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, total = [], 0
    while total < n_chars:
        s = sentence(rng)
        parts.append(s)
        total += len(s) + 1
    return " ".join(parts)[:n_chars]
