"""`python -m jaxrl_async.main`: the entry point of ``cli/main.py`` (see its documentation)."""
import sys

from jaxrl_async.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
