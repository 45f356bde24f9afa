"""The example's reward: a completion earns the share of the answer's digits it repeats in place.

Written as TRL writes reward functions (`prompts=`, `completions=`, and the prompt lines' other
fields as keyword lists), so the same function trains d9d's GRPOTask and TRL's GRPOTrainer.
"""


def copy_digits(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 for a completion that starts with the answer's digits, 0.5 for one of two right, ..."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        digits = "".join(ch for ch in completion if ch.isdigit())
        rewards.append(sum(a == b for a, b in zip(digits, expected, strict=False)) / len(expected))
    return rewards
