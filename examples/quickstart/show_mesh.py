"""Print the device-mesh layout of a job config, planned in one process (no GPUs needed).

uv run python examples/quickstart/show_mesh.py examples/quickstart/config.yaml
uv run python examples/quickstart/show_mesh.py config.yaml --set data_parallel_shard=8 --set tensor_parallel=4
"""

import argparse
import sys
from pathlib import Path

import msgspec
import yaml

from d9d.mesh import D9dError, DistributedContext, MeshConfig


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", type=Path)
    parser.add_argument(
        "--set", action="append", default=[], metavar="DEGREE=N", help="override a mesh degree"
    )
    args = parser.parse_args()
    try:
        raw = yaml.safe_load(args.config.read_text()) or {}
        mesh = dict(raw.get("mesh") or {})
        for item in args.set:
            key, _, value = item.partition("=")
            mesh[key.removeprefix("mesh.")] = int(value)
        config = msgspec.convert(mesh, MeshConfig)
    except (OSError, ValueError, msgspec.ValidationError, D9dError) as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    with DistributedContext.for_planning(config) as ctx:
        print(ctx.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
