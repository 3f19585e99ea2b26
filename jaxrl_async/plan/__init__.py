"""Planning without the hardware: ``planner`` (will a run fit its devices: the run's own programs compiled
for the target, memory per role, suggestions) and ``aot`` (compile-only TPU slices and H100 target
descriptions). The command line is ``python -m jaxrl_async.plan`` (``cli/plan.py``). Importing this package
starts no JAX backend: the planner sets the simulated device count first.
"""
