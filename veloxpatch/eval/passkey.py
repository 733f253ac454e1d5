"""Seeded passkey retrieval cases: a five-digit key hidden at a chosen depth of
real prose, the question at the end, wrapped in the chat template."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from ..loading.models import chat_prompt
from ..prose import prose_length, prose_tokens

# Phrased as a "secret number": the evaluation prose is Python documentation, and
# SmolLM2 answers "pass key" questions about Python keys instead (measured: 0/5
# with the classic pass-key wording, 5/5 with this one, uncompressed). The
# assistant turn is opened with ANSWER so the model continues with the digits.
INTRO = (
    "There is a secret number hidden inside a long text. Find it and memorize it. "
    "I will quiz you about it.\n\n"
)
NEEDLE = " The secret number is {key}. Remember it. {key} is the secret number. "
QUESTION = "\n\nWhat is the secret number mentioned in the text?"
ANSWER = "The secret number is"


@dataclass
class PasskeyCase:
    prompt: list[int]  # token ids, chat template applied
    key: str
    depth: float  # where the needle sits in the prose, 0..1
    seed: int
    lead_in: int = 0  # the last `lead_in` prompt tokens are ANSWER, the lead-in

    def correct(self, answer: str) -> bool:
        return self.key in answer.replace(" ", "")


def hidden_key(tokenizer, context_tokens, depth, seed, text_split):
    """(key, the instructions and the prose with the key at `depth`)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    # Each case reads its own stretch of prose, chosen by the seed.
    filler_len = context_tokens - 80
    start = rng.randint(0, prose_length(tokenizer, text_split) - filler_len)
    filler = prose_tokens(tokenizer, filler_len, text_split, start=start)
    cut = int(round(depth * filler_len))
    before = tokenizer.decode(filler[:cut])
    after = tokenizer.decode(filler[cut:])
    return key, INTRO + before + NEEDLE.format(key=key) + after


def make_case(
    tokenizer,
    context_tokens: int,
    depth: float,
    seed: int,
    text_split: str = "evaluation",
    chat: bool | None = None,
) -> PasskeyCase:
    key, body = hidden_key(tokenizer, context_tokens, depth, seed, text_split)
    body += QUESTION
    text = chat_prompt(tokenizer, body, chat)
    plain = text == body  # no chat template: a completion prompt, with BOS
    text += "\n" if plain else ""
    ids = tokenizer.encode(text + ANSWER, add_special_tokens=plain)
    question = tokenizer.encode(text, add_special_tokens=plain)
    lead_in = len(ids) - len(question) if ids[: len(question)] == question else 0
    return PasskeyCase(ids, key, depth, seed, lead_in)


# The question-agnostic protocol asks each compressed context twice, in two
# phrasings, after compression; one code per context (with three labelled codes
# uncompressed SmolLM2 confuses the labels).
QUESTIONS = (QUESTION, "\n\nWhich number did the text tell you to remember?")
_MARK = "\x00question\x00"


@dataclass
class AgnosticCase:
    context: list[int]  # the chat template's head and the text, no question
    questions: list[list[int]]  # each: the question, the turn change, ANSWER
    key: str
    depth: float
    seed: int

    def correct(self, answer: str) -> bool:
        return self.key in answer.replace(" ", "")


def make_agnostic_case(
    tokenizer, context_tokens: int, depth: float, seed: int, text_split="evaluation"
) -> AgnosticCase:
    """The same text and key as `make_case`, split where the question starts."""
    key, body = hidden_key(tokenizer, context_tokens, depth, seed, text_split)
    text = chat_prompt(tokenizer, body + _MARK)
    plain = text == body + _MARK  # no chat template: a completion prompt
    head, tail = text.split(_MARK)
    tail += "\n" if plain else ""
    context = tokenizer.encode(head, add_special_tokens=plain)
    questions = [
        tokenizer.encode(q + tail + ANSWER, add_special_tokens=False) for q in QUESTIONS
    ]
    return AgnosticCase(context, questions, key, depth, seed)


def make_cases(
    tokenizer,
    n: int,
    context_tokens: int = 1500,
    seed: int = 0,
    depths=(0.05, 0.95),
    text_split: str = "evaluation",
    agnostic: bool = False,
):
    """`n` cases with depths spread evenly over [depths[0], depths[1]]."""
    lo, hi = depths
    make = make_agnostic_case if agnostic else make_case
    return [
        make(
            tokenizer,
            context_tokens,
            lo + (hi - lo) * i / max(1, n - 1),
            seed * 100_003 + i,
            text_split,
        )
        for i in range(n)
    ]


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def sign_test(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p of paired right/wrong answers: `only_a`
    answers only arm a missed, `only_b` only arm b; ties carry nothing."""
    n = only_a + only_b
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_interval(diffs: list[float], resamples: int = 2000) -> list[float]:
    """95% bootstrap interval (seeded) of the mean of paired differences."""
    rng = random.Random(0)
    means = sorted(
        statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples)
    )
    return [means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]]
