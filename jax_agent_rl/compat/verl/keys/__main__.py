"""``python -m jax_agent_rl.compat.verl.keys``: prints `TABLE` as docs/verl.md's table."""

from jax_agent_rl.compat.verl.keys.convert import markdown_table

print(markdown_table(), end="")
