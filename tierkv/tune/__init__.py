"""Tuning, at the top of the tree: replay recorded access traces through the real tier manager and rank policies.

``replay`` drives a `tierkv.manager.TierManager` on a simulated clock; ``tune`` sweeps policies,
prefetchers and budgets over one trace. Traces are recorded by `tierkv.profile.access` during a run.
"""
