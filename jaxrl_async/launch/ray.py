"""``python -m jaxrl_async.launch.ray``: the roles of a run on an existing Ray cluster (``distributed.ray_launch``)."""
import sys

from jaxrl_async.distributed.ray_launch import main

if __name__ == "__main__":
    sys.exit(main())
