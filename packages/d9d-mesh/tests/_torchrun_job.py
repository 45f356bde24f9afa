"""A tiny job for torchrun tests: build the context from a JSON mesh, log, all-reduce, report."""

import json
import sys

import torch
import torch.distributed as dist

from d9d.mesh import D9dError, DistributedContext, MeshConfig, configure_logging, get_logger


def main() -> int:
    mesh = MeshConfig(**json.loads(sys.argv[1]))
    log_dir = sys.argv[2] if len(sys.argv) > 2 else None
    fmt = sys.argv[3] if len(sys.argv) > 3 else "console"
    try:
        ctx = DistributedContext.from_env(mesh, device="cpu")
    except D9dError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with ctx:
        configure_logging(ctx, log_dir=log_dir, format=fmt)
        total = torch.tensor([float(ctx.rank)])
        if not ctx.is_local:
            dist.all_reduce(total)
        get_logger("job").info("reduced", total=float(total), dense=ctx.coordinates["dense"])
        import logging

        logging.getLogger("torch.fake").warning("a stdlib record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
