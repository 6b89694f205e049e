"""Rewards: verl's rule scorers (registered by the verl wing, `jax_agent_rl.compat.verl.rules`,
checked against verl's own; `jax_agent_rl.rewards.hooks`), our answer checkers (math, lenient
GSM8K, format), user functions named in the config (ours or verl's ``compute_score``
signature), a model as the judge, and the choice of reward per ``data_source``."""

from jax_agent_rl.rewards.hooks import REWARDS, RewardFn, reads_whole_response
from jax_agent_rl.rewards.judge import Judge, JudgeAnswerError, judge_prompt, parse_score
from jax_agent_rl.rewards.math import (
    extract_answer,
    format_reward,
    gsm8k_answer,
    gsm8k_lenient_reward,
    math_equal,
    math_reward,
)
from jax_agent_rl.rewards.registry import (
    JUDGE,
    MAX_ABS_REWARD,
    Answer,
    AnswerFaultError,
    JudgeFn,
    RewardError,
    Rewards,
    ScoreFn,
    Scorer,
    checked_reward,
    load_reward,
    make_reward,
    scored_by_fallback,
)

__all__ = [
    "JUDGE",
    "MAX_ABS_REWARD",
    "REWARDS",
    "Answer",
    "AnswerFaultError",
    "Judge",
    "JudgeAnswerError",
    "JudgeFn",
    "RewardError",
    "RewardFn",
    "Rewards",
    "ScoreFn",
    "Scorer",
    "checked_reward",
    "extract_answer",
    "format_reward",
    "gsm8k_answer",
    "gsm8k_lenient_reward",
    "judge_prompt",
    "load_reward",
    "make_reward",
    "math_equal",
    "math_reward",
    "parse_score",
    "reads_whole_response",
    "scored_by_fallback",
]
