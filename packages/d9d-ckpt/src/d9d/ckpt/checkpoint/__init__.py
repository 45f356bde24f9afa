"""Crash-safe sharded checkpoints of a run: `save-<step>/` directories, resume discovery, retention.

    from d9d.ckpt import CheckpointManager, capture_rng_state

    manager = CheckpointManager("runs", "my-run", num_to_keep=3)
    manager.save(step, model, optimizer, extra_state={"data": data_state}, rank_state=capture_rng_state())
    loaded = manager.load(manager.latest(), model, optimizer)

Every commit records a checksum per file; `CheckpointManager(..., verify_on_load=True)` and
`verify_checkpoint(info)` compare them (`integrity.py`). `classify_run_entry` tells the names of a
run directory apart, `list_checkpoints` lists a run's committed checkpoints (`layout.py`).

Public names are exported from `d9d.ckpt` (listing a run and verifying its files import no torch).
"""
