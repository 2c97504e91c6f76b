"""The syncer daemon: round state machine, service glue and the checkpoint store (docs/design.md §2, §3.5)."""
