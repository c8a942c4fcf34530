"""The `specsplit` command (`commands`; `python -m specsplit` runs it): `up`'s launcher and supervisor, the
drafter's placement, the trace viewer. Torch-free."""
