import os
import sys

# Imported once in the parent because every forked rank needs them; a rank that imports them itself
# pays seconds (dynamo alone ~6 s on a busy 2-core machine).
import torch._dynamo
import torch.distributed._composable.replicate_with_fsdp
import torch.distributed.fsdp
import torch.distributed.tensor.parallel  # noqa: F401

# Test-support modules (`_tiny_transformer`, `_train_compare`) live beside the tests; pytest runs in
# importlib mode, which does not put this folder on sys.path by itself.
sys.path.insert(0, os.path.dirname(__file__))
