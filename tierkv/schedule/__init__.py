"""FlexGen-style batch offload: policy, cost model, search, plan and runner (see each module).

    policy.py     where weights / KV / activations live, batch shape (a frozen value)
    plan.py       the zig-zag block schedule as a pure generator of steps
    runner.py     executes a plan, overlapping load-next / compute / store-previous
    engine.py     a model prepared for one policy: tiers sized, weights placed
    cost.py       predicted throughput of a policy on this machine
    calibrate.py  the machine's measured rates, cached
    search.py     the policy that maximizes predicted throughput within the budgets (LP)
    command.py    ``tierkv batch``
"""
