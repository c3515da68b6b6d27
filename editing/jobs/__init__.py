"""Experiment pipelines as plain functions of (config, workdir): what each launch job runs.

`launch/<job>.py` parses flags and calls `<job>.run` here (or in `merging.jobs` for the jobs
that merge); a notebook calls the same functions. `workdir` holds the layout of an experiment's
directory, `experiment` what every job reads from the config (tasks, regimes, the backbone,
the frozen heads, the evaluator).
"""
