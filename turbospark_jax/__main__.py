"""``python -m turbospark_jax``: the same command as ``turbospark-jax``."""

import sys

from turbospark_jax.cli import main

sys.exit(main())
