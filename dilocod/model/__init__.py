"""The model as both daemons see it, beneath them both: the user's entry (entry.py), the fragment
plan (plan.py), the parameters' table as JOIN and PLAN list it (params.py), and the comparison of
two sides' tables (compare.py). The syncer and the learner stand on it and never import each
other; it imports the wire's types and the entry contract, never networking, the syncer or the
learner (tests/unit/test_layering.py)."""
