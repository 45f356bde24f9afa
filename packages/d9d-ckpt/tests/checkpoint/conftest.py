import os
import sys

# `_ckpt_testlib` lives beside the tests; pytest's importlib mode does not put this folder on sys.path.
sys.path.insert(0, os.path.dirname(__file__))
# Import what forked ranks need before any fork, so that each rank starts in well under a second.
import torch._dynamo
import torch.distributed.fsdp
import torch.distributed.tensor  # noqa: F401
