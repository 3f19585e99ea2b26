from jaxrl_async.sharding.activations import activation_rules, constrain, traced_with_activation_rules
from jaxrl_async.sharding.mesh import make_mesh, split_devices
from jaxrl_async.sharding.rules import (
    GENERATOR_RULES, RULE_SETS, TRAINER_RULES, activation_sharding, get_rules, logical_to_spec,
    tree_shardings,
)

__all__ = [
    "make_mesh", "split_devices", "GENERATOR_RULES", "TRAINER_RULES", "RULE_SETS", "activation_sharding",
    "get_rules", "logical_to_spec", "tree_shardings", "activation_rules", "constrain",
    "traced_with_activation_rules",
]
