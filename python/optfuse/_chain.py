"""Small helpers over the core: concatenating chains and making state arrays."""
from ._core import Rule, parse_chain


def chain(*parts):
    """Concatenates rules, chains (lists of rules) and SPEC text into one chain (a list of Rule).

        optfuse.chain(my_rule, optfuse.make_builtin("scale_by_learning_rate", lr=1e-2))
    """
    out = []
    for part in parts:
        if isinstance(part, Rule):
            out.append(part)
        elif isinstance(part, str):
            out.extend(parse_chain(part))
        elif isinstance(part, (list, tuple)):
            out.extend(chain(*part))
        else:
            raise TypeError(f"optfuse.chain: expected a Rule, a list of Rule or SPEC text, got {type(part).__name__}")
    return out


def init_states(optimizer, param):
    """NumPy state arrays for one parameter, each filled with its slot's initial value (a copy of the
    parameter for a slot that starts as one: schedule-free's z, a master copy), in the optimizer's
    state order: what set_tensors expects as the third item of a tensor tuple."""
    import numpy as np

    return [np.array(param, copy=True) if from_param else np.full(param.shape, init, dtype=param.dtype)
            for (_, _, init), (from_param, _) in zip(optimizer.state_specs, optimizer.state_storage)]
