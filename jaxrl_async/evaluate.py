"""`python -m jaxrl_async.evaluate`: the entry point of ``cli/evaluate.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
