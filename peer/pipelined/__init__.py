"""A peer's part in a pipelined experiment: its stage, its budget, its checkpoints, its trainer."""
