"""``python -m jax_agent_rl.cli``."""

import sys

from jax_agent_rl.cli import main

sys.exit(main())
