"""optfuse's PyTorch front end: drop-in fused optimizers (torch.optim.Optimizer subclasses with
torch's arguments, param_groups and state_dict format), Fused for any optfuse chain, and fuse() to
turn a running torch optimizer into its fused equivalent.

    import optfuse.torch
    opt = optfuse.torch.AdamW(model.parameters(), lr=3e-4)
"""
from ._adafactor import Adafactor  # noqa: F401
from ._base import FusedOptimizer, OptfuseError  # noqa: F401
from ._fused import Fused, explain, fuse  # noqa: F401
from ._layerwise import Lamb, Lars  # noqa: F401
from ._muon import Muon, MuonWithAuxAdam  # noqa: F401
from ._q8 import dequantize as dequantize_int8_state  # noqa: F401
from ._schedule_free import AdamWScheduleFree  # noqa: F401
from ._optimizers import (ASGD, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, AdEMAMix, Lion, NAdam, RAdam,  # noqa: F401
                          RMSprop, Rprop)

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta", "Rprop", "ASGD", "Adafactor", "Lion", "AdEMAMix",
           "AdamWScheduleFree", "Lamb", "Lars", "Muon", "MuonWithAuxAdam", "Fused", "fuse", "explain", "FusedOptimizer",
           "dequantize_int8_state"]
