"""The syncer daemon: round state machine, service glue and the checkpoint store (DESIGN.md §2, §3.5)."""
