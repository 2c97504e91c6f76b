"""The model as both daemons see it, beneath them both: the user's entry (entry.py), the fragment
plan (plan.py), the parameters' table as JOIN and PLAN list it (params.py), the comparison of
two sides' tables (compare.py), and outer gradients encoded at each wire precision
(precision.py). The syncer and the learner stand on it and never import each other; it imports
the wire's types, the entry contract and the outer math, never networking, the syncer or the
learner (tests/unit/test_layering.py)."""
