"""verl's Hydra keys in jarl's terms: one table, read by the override parser and by docs/verl.md.

A verl run script's overrides (``actor_rollout_ref.rollout.n=16``, ``data.train_files=...``)
can be passed to any jarl command as they are. `to_jarl` rewrites each verl key that has an
equivalent into jarl overrides, saying so once, one line each::

    verl key actor_rollout_ref.rollout.n=16 -> group.n=16

accepts the keys whose effect jarl already has (an engine, memory or layout detail of verl's
FSDP / Megatron / SGLang workers, or a value saying what jarl always does), naming them all in
one note with why each needs nothing here, and refuses the keys jarl cannot honour with one
`ConfigError` line each, saying why and what to use instead.

Some equivalents are traps, converted rather than copied (``trap`` in `TABLE`): verl's
``ppo_mini_batch_size`` is a size in prompts, jarl's ``algorithm.mini_batches`` a count
(``data.prompts_per_step / ppo_mini_batch_size``, which must divide); verl's ``*_per_gpu`` sizes
are per device, jarl's ``learner.micro_batch_size`` is over the data-parallel devices;
``max_prompt_length`` becomes part of ``engine.max_model_len``; epochs become steps.

A conversion reads the final value of the jarl keys it depends on (``data.prompts_per_step``
for mini-batches, ...), whichever spelling set it and in whatever order the overrides came,
as Hydra applies a command line's overrides together. A jarl key set both directly and through
a verl key is an error: keep one.

``python -m jax_agent_rl.compat.verl.keys`` prints `TABLE` as the markdown table of docs/verl.md
(tests/test_verl_keys.py checks that the two agree).
"""

from jax_agent_rl.compat.verl.keys.convert import TABLE, count_rows, find, markdown_table, to_jarl
from jax_agent_rl.compat.verl.keys.rules import VERL_SECTIONS, Given, VerlKey

__all__ = [
    "TABLE",
    "VERL_SECTIONS",
    "Given",
    "VerlKey",
    "count_rows",
    "find",
    "markdown_table",
    "to_jarl",
]
