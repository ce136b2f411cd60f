#!/usr/bin/env python3
"""Converts a released router checkpoint to the files tokenrouter's policies load.

    convert-router.py CHECKPOINT.pt OUT.safetensors

Reads either layout the algorithms' authors release (docs/policies.md):
  - R2R: a pickled dict with `model_type`, `init_args`, `common_args` (`threshold`, ...),
    `model_specific_args` and `state_dict`, written by torch.save (needs weights_only=False);
  - CITER: a plain `state_dict`.
Writes the state dict's tensors, under their released names, to OUT.safetensors, and every
other entry of the dict to OUT.json, the sidecar whose `common_args.threshold` the loader
uses when a policy sets no threshold. Needs torch, safetensors and numpy (CPU is enough).
"""

import json
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import torch
    from safetensors.torch import save_file

    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    if not source.is_file():
        print(f"error: {source}: no such file", file=sys.stderr)
        return 1
    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    if not isinstance(checkpoint, dict):
        print(f"error: {source} holds a {type(checkpoint).__name__}, not a dict", file=sys.stderr)
        return 1
    released = isinstance(checkpoint.get("state_dict"), dict)
    state = checkpoint["state_dict"] if released else checkpoint
    tensors = {
        name: value.detach().contiguous()
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and not name.endswith("num_batches_tracked")
    }
    if not tensors:
        print(f"error: {source} has no tensors in its state dict", file=sys.stderr)
        return 1
    save_file(tensors, str(out))
    sidecar = {k: v for k, v in checkpoint.items() if k != "state_dict"} if released else {}
    out.with_suffix(".json").write_text(json.dumps(sidecar, indent=2, default=str) + "\n")
    print(f"{len(tensors)} tensors -> {out}, metadata -> {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
