"""Group-relative advantages: each rollout's reward minus the mean reward of its group (same task, same policy).

No division by the group's standard deviation: a group whose rewards are all equal carries no signal and gets
zero advantages, and a nearly-uniform group is not blown up into large ones.
"""


def group_advantages(rewards: list[float]) -> list[float]:
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]
