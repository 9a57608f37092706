"""A reward with partial credit for examples/tiny-grpo.yaml: a user's own reward function, as
training.grpo.rewards names it (``type: function, function: rewards/arithmetic.py:answer``).

Called with the prompts, the completions (text) and the records (each prompts record as the
file has it), it returns one float per completion. Partial credit makes a group's completions
score differently even while the model is far from right, which is what GRPO learns from: a
random model that never writes the answer still earns something for writing digits.
"""

from __future__ import annotations


def answer(prompts, completions, records, **_):
    """1 for the right number first; else half the share of digits in the first 6 characters
    written (a number-shaped answer), which the model can learn before it can add."""
    scores = []
    for text, record in zip(completions, records, strict=True):
        written = text.strip()
        if written.split()[:1] == [str(record["answer"])]:
            scores.append(1.0)
            continue
        head = written.replace(" ", "")[:6]
        scores.append(0.5 * sum(c.isdigit() for c in head) / 6)
    return scores
