"""`python -m jaxrl_async.generate`: the entry point of ``cli/generate.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
