"""The learner daemon: the runtime around the user's training step (DESIGN.md §3.3, §6)."""
