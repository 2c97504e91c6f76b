"""The learner daemon: the runtime around the user's training step (docs/design.md §3.3, §6)."""
