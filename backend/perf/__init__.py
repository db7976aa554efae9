"""Hardware what-if: a roofline cost model of one engine iteration (docs/perf_model.md).

shapes.py: models without weights · hardware.py: GPU profiles · calibrate.py: this machine measured ·
link_calibrate.py: its ranks' link measured · machine_cache.py: their figures kept ·
least_squares.py: the non-negative fits · ring.py: a ring all-reduce's bytes ·
cost_model.py: FLOPs, bytes and time of an iteration's batch ·
whatif.py: `kvscope whatif` ·
simulate.py: the engine on a shape, each iteration priced (`kvscope run --simulate`).
"""
