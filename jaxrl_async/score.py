"""`python -m jaxrl_async.score`: the entry point of ``cli/score.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.score import main

if __name__ == "__main__":
    sys.exit(main())
