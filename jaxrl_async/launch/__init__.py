"""The launchers, by where the run goes (AReaL's ``areal.launcher.{local,ray,slurm}``):

* ``python -m jaxrl_async.launch.local``: the roles on this host (``distributed.launch``);
* ``python -m jaxrl_async.launch.ray``: the roles on an existing Ray cluster (``distributed.ray_launch``; needs the
  ``ray`` extra);
* SLURM: the role modules under ``srun`` (``docs/launch.md`` section 3).
"""
